"""Where does the DDP hook's extra time per step go, against the standalone optimizer?

    python -m experiments.optim.profile_ddp_hook          # per-step forward/backward/step() ms
    python -m experiments.optim.profile_ddp_hook --profile   # and a cProfile of rank 0

Two forked gloo ranks on loopback, the tcp benchmark's 25.2M-parameter WideMLP, 1-bit Adam in
its compression stage, in one run, twice: the standalone optimizer; DDP with commopt's hook
running the exchange in backward (``exchange_in_backward=True``) or in ``step()`` (``False``),
each with and without ``gradient_as_bucket_view=True``; and the hook's default (``None``: here,
on CPU, the exchange in ``step()``) with bucket views, as a user who sets nothing but DDP's
option gets it. Prints each mode's median forward/backward/step() ms and its ratio to the
standalone optimizer of the same round.
"""

import argparse
import cProfile
import io
import pstats
import time

import torch
from torch.nn.parallel import DistributedDataParallel

import commopt
from experiments.harness import run_ranks
from experiments.tcp.bench import WideMLP


def run(backend, mode, prof):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = WideMLP(1024, 4096, 1)
    m = (
        DistributedDataParallel(model, gradient_as_bucket_view=mode.endswith("view"))
        if mode.startswith("ddp")
        else model
    )
    opt = commopt.OnebitAdam(m.parameters(), lr=1e-6, freeze_step=2, backend=backend)
    if mode.startswith("ddp"):
        where = {"early": True, "late": False, "default": None}[mode.split("-")[1]]
        state = commopt.ddp.OnebitHookState(opt, exchange_in_backward=where)
        m.register_comm_hook(state, commopt.ddp.onebit_hook)
    g = torch.Generator().manual_seed(backend.rank)
    x, y = torch.randn(4, 1024, generator=g), torch.randn(4, 1024, generator=g)
    times = []
    pr = cProfile.Profile()
    for step in range(8):
        t0 = time.perf_counter()
        if step >= 4 and prof and backend.rank == 0:
            pr.enable()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(m(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if step >= 4 and prof and backend.rank == 0:
            pr.disable()
        times.append((t1 - t0, t2 - t1, t3 - t2))
    out = ""
    if prof and backend.rank == 0:
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        out = s.getvalue()
    return [tuple(round(1e3 * v) for v in t) for t in times[4:]], out


MODES = (
    "standalone",
    "ddp-early",
    "ddp-early-view",
    "ddp-late",
    "ddp-late-view",
    "ddp-default-view",
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--profile", action="store_true", help="print rank 0's cProfile too")
    parser.add_argument("--rounds", type=int, default=2, help="repeats of every mode (2)")
    args = parser.parse_args(argv)
    prof = args.profile
    for round_ in range(1, args.rounds + 1):
        print(f"round {round_}: mode, median fwd/bwd/step ms, total, ÷ standalone")
        totals = {}
        for mode in MODES:
            r = run_ranks(run, 2, mode, prof, timeout=300)
            steps = r[0][0]
            parts = [sorted(step[i] for step in steps)[len(steps) // 2] for i in range(3)]
            totals[mode] = sorted(sum(step) for step in steps)[len(steps) // 2]
            ratio = totals[mode] / totals["standalone"]
            print(f"  {mode:18s} {parts} {totals[mode]:5d} ms  {ratio:.2f}x")
            if prof:
                print(r[0][1])


if __name__ == "__main__":
    main()
