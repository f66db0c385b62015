r"""Where one rank's 1-bit Adam compression-stage ``step()`` spends its time, phase by phase.

Forks ``--world-size`` gloo ranks (loopback) holding experiments/tcp's WideMLP shapes
(25,175,040 parameters by default) and fixed random gradients, runs ``OnebitAdam`` past its
warmup, then takes ``--steps`` steps under :mod:`cProfile` and prints the inclusive time of the
functions that do each phase (the gradient agreement, the momentum fold, each kernel of the
compressed allreduce, the compression-error dot product, the mask, the denominator, the step
guard, the update), found in the profile by qualified name (:mod:`experiments.harness.profiling`).
What is left of the exchange after its kernels is waiting on the wire and on the other ranks.
Every other step of the ``--steps`` is taken without the profiler, so its own cost shows
(``step() wall`` profiled and not). Rank 0's median per step is printed (a phase never called:
``-``), with the process CPU time per plain step of every rank.

``--digest`` also prints a sha256 of the parameters and state after the run (per rank): a
change to the kernels or the update must leave it unchanged (this covers the large, pipelined
buffers that ``experiments.optim.state_digest``'s small model never reaches).
``--steps 6 --digest`` printed ``b27af669b7bc2e93 2076cc39ea52b5ae 55d10eb24e799711
7e094a22c5a98aaa`` from the step-time work of 2026-11-22 to 2026-11-26.

Usage::

    python -m experiments.optim.profile_step [--world-size 4] [--steps 6] [--digest]

(The before/after columns of that work in docs/performance.md came from a ``--compare`` mode
that patched the old step guard back into private internals; it was removed once they were
recorded. To see them again: ``git checkout e8945bb`` and run this module with ``--compare``.)
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import hashlib
import statistics
import time

import torch
import torch.distributed as dist

import commopt
from experiments.harness import describe_machine, launch, rank_and_size
from experiments.harness.profiling import inclusive_times

__all__ = ["PHASES", "main"]

_SHAPES = [(4096, 1024), (4096,), (4096, 4096), (4096,), (1024, 4096), (1024,)]


#: (row label, the function whose inclusive time it is), in the order printed
PHASES = [
    ("agree (finite check)", "commopt.optim._agreement.GradientAgreement.verdict"),
    ("momentum fold", "commopt.optim.adam.momentum_from_grads_"),
    ("exchange (total)", "commopt.optim._communication.Communication.compress"),
    ("  kernel: worker scale", "commopt.kernels.numba_kernels.NumbaKernels.scale"),
    ("  kernel: worker pack", "commopt.kernels.numba_kernels.NumbaKernels.pack_compensated_"),
    ("  kernel: server average", "commopt.kernels.numba_kernels._NumbaServerStages.average_"),
    ("  kernel: server pack", "commopt.kernels.numba_kernels._NumbaServerStages.pack_"),
    ("  kernel: server (unstaged)", "commopt.kernels.numba_kernels.NumbaKernels.server_reduce_"),
    ("  kernel: unpack", "commopt.kernels.numba_kernels.NumbaKernels.unpack_scaled_"),
    ("  compression-error dot", "<method 'dot' of 'torch._C.TensorBase' objects>"),
    ("mask", "commopt.optim.base.BucketOps.mask"),
    ("update (total)", "commopt.optim.onebit_adam.OnebitAdam._apply_update"),
    ("  denominator", "commopt.optim.flat_state.FlatState.denominator"),
    ("  step guard + addcdiv", "commopt.optim.adam.guarded_adam_update_"),
    ("    step guard: its elements", "commopt.optim.adam.guarded_elements"),
]


def _state_digest(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().numpy().tobytes())
    for state in opt.flat_states:
        for key in sorted(state.flat):
            h.update(state.flat[key].numpy().tobytes())
        for key in sorted(state.comm):
            h.update(state.comm[key].numpy().tobytes())
    return h.hexdigest()[:16]


def _run(steps: int, digest: bool, guard: bool | str, label: str) -> dict:
    rank, n = rank_and_size()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in _SHAPES]
    gen = torch.Generator().manual_seed(1 + rank)
    opt = commopt.OnebitAdam(params, lr=1e-4, freeze_step=2, step_guard=guard)

    def step() -> None:
        for p in params:  # new gradients every step, so the state keeps moving
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()

    for _ in range(4):  # 2 warmup steps, then past the first compressed exchanges
        step()
    per_step: dict[str, list[float]] = collections.defaultdict(list)
    cpu: list[float] = []
    for i in range(steps):  # profiled and plain steps interleaved: both see the same load
        profiled = i % 2 == 0
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        profile = cProfile.Profile()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        if profiled:
            profile.enable()
        opt.step()
        profile.disable()
        wall = time.perf_counter() - t0
        if not profiled:
            per_step["step() wall, not profiled"].append(wall)
            cpu.append(time.process_time() - c0)
            continue
        per_step["step() wall, profiled"].append(wall)
        for name, seconds in inclusive_times(profile, (n for _, n in PHASES)).items():
            per_step[name].append(seconds)
    cpu_all = [0.0] * n
    cpu_all[rank] = statistics.median(cpu) * 1e3
    t = torch.tensor(cpu_all, dtype=torch.float64)
    dist.all_reduce(t)
    digests = [None] * n
    dist.all_gather_object(digests, _state_digest(opt, params) if digest else "")
    return {
        "phases_ms": {k: statistics.median(v) * 1e3 for k, v in per_step.items()},
        "cpu_ms_per_rank": t.tolist(),
        "digests": digests,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--digest", action="store_true")
    parser.add_argument("--step-guard", choices=("tiny", "off"), default="tiny")
    parser.add_argument("--label", default="")
    args = parser.parse_args(argv)
    guard: bool | str = False if args.step_guard == "off" else "tiny"
    r = launch(_run, args.world_size, args.steps, args.digest, guard, args.label)
    if r is None:
        return 0
    machine = describe_machine()
    print(f"# {args.label} OnebitAdam compression step, {args.world_size} ranks; {machine}")
    print("| phase (rank 0, ms/step, median) | ms |")
    print("|---|---|")
    rows = [("step() wall, not profiled",) * 2, ("step() wall, profiled",) * 2, *PHASES]
    for label, name in rows:
        ms = r["phases_ms"].get(name)
        print(f"| {label} | {'-' if ms is None else f'{ms:.1f}'} |")
    cpus = ", ".join(f"{c:.0f}" for c in r["cpu_ms_per_rank"])
    print(f"| CPU ms/step per rank (steps not profiled) | {cpus} |")
    if args.digest:
        print("digest", " ".join(r["digests"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
