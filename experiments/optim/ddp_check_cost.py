"""What the "DDP without commopt's hook" check costs: at its first two communicating steps
``step()`` digests every gradient (one pass over them) to find gradients DDP already averaged.

    python -m experiments.optim.ddp_check_cost

2 forked gloo ranks on loopback, the tcp benchmark's 25.2M-parameter MLP, 1-bit Adam in its
warmup (every step communicates). The first three steps of 3 fresh optimizers run under
:mod:`cProfile`; printed per step, rank 0's median ms: ``step()`` wall and the inclusive time of
the digest (``gradient_digest``, found by qualified name: :mod:`experiments.harness.profiling`).
Step 3 digests nothing: it is the step without the check, measured in the same run.
"""

import argparse
import cProfile
import statistics
import time

import torch

import commopt
from experiments.harness import describe_machine, run_ranks
from experiments.harness.profiling import inclusive_times
from experiments.tcp.bench import WideMLP

DIGEST = "commopt.optim._agreement.gradient_digest"


def run(backend: commopt.Backend) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = WideMLP(1024, 4096, 1)
    g = torch.Generator().manual_seed(backend.rank)
    x, y = torch.randn(4, 1024, generator=g), torch.randn(4, 1024, generator=g)
    walls: list[list[float]] = [[], [], []]
    digests: list[list[float]] = [[], [], []]
    for _ in range(3):
        opt = commopt.OnebitAdam(model.parameters(), lr=1e-6, freeze_step=100, backend=backend)
        for k in range(3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            profile = cProfile.Profile()
            t = time.perf_counter()
            profile.enable()
            opt.step()
            profile.disable()
            walls[k].append(time.perf_counter() - t)
            digests[k].append(inclusive_times(profile, [DIGEST]).get(DIGEST, 0.0))
    return {
        "step": [round(1e3 * statistics.median(w), 1) for w in walls],
        "digest": [round(1e3 * statistics.median(d), 1) for d in digests],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=2, help="repeats of the run (default 2)")
    args = parser.parse_args(argv)
    print(f"# 2 gloo ranks, 25.2M-parameter MLP, OnebitAdam warmup; {describe_machine()}")
    for _ in range(args.rounds):
        r = run_ranks(run, 2, timeout=300)[0]
        print("step() ms for steps 1, 2, 3:", r["step"], "  of which the digest:", r["digest"])


if __name__ == "__main__":
    main()
