r"""Where one rank's 1-bit Adam compression-stage ``step()`` spends its time, phase by phase.

Forks ``--world-size`` gloo ranks (loopback) holding experiments/tcp's WideMLP shapes
(25,175,040 parameters by default) and fixed random gradients, runs ``OnebitAdam`` past its
warmup, then times ``--steps`` steps with the phases of the step wrapped in timers (the
gradient agreement, the momentum fold, each kernel of the compressed allreduce, the
compression-error dot product, the mask, the denominator, the step guard, the update). What
is left of the exchange after its kernels is waiting on the wire and on the other ranks.
Rank 0's median per step is printed, with the process CPU time per step of every rank.

``--digest`` also prints a sha256 of the parameters and state after the run (per rank): a
change to the kernels or the update must leave it unchanged (this covers the large, pipelined
buffers that ``experiments.optim.state_digest``'s small model never reaches).

Usage::

    python -m experiments.optim.profile_step [--world-size 4] [--steps 6] [--digest] [--compare]

``--compare`` interleaves steps taken as before the CPU-cost changes of issue #12 (the step
guard's bound, indices, denominator copy and gather/scatter as they were; same results) with
steps taken as now, in the same processes, and prints both columns.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

import commopt
from experiments.common.training import describe_machine, launch, rank_and_size

__all__ = ["main"]

_SHAPES = [(4096, 1024), (4096,), (4096, 4096), (4096,), (1024, 4096), (1024,)]


class _Timers:
    def __init__(self) -> None:
        self.totals: dict[str, float] = collections.defaultdict(float)
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        original = getattr(owner, attr)
        totals = self.totals

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - t0

        setattr(owner, attr, timed)
        self._undo.append(lambda: setattr(owner, attr, original))

    def undo(self) -> None:
        for fn in reversed(self._undo):
            fn()


@contextlib.contextmanager
def _instrumented() -> Iterator[_Timers]:
    import commopt.optim._adam as adam
    import commopt.optim._agreement as agreement
    import commopt.optim._communication as communication
    import commopt.optim.onebit_adam as onebit_adam
    from commopt.kernels import numba_kernels
    from commopt.optim.flat_state import FlatState

    timers = _Timers()
    timers.wrap(agreement.GradientAgreement, "verdict", "agree (finite check)")
    timers.wrap(onebit_adam, "momentum_from_grads_", "momentum fold")
    timers.wrap(communication.Communication, "compress", "exchange (total)")
    timers.wrap(numba_kernels.NumbaKernels, "scale", "  kernel: worker scale")
    timers.wrap(numba_kernels.NumbaKernels, "pack_compensated_", "  kernel: worker pack")
    timers.wrap(numba_kernels._NumbaServerStages, "average_", "  kernel: server average")
    timers.wrap(numba_kernels._NumbaServerStages, "pack_", "  kernel: server pack")
    timers.wrap(numba_kernels.NumbaKernels, "server_reduce_", "  kernel: server (unstaged)")
    timers.wrap(numba_kernels.NumbaKernels, "unpack_scaled_", "  kernel: unpack")
    timers.wrap(torch.Tensor, "dot", "  compression-error dot")
    timers.wrap(onebit_adam.OnebitAdam, "_mask", "mask")
    timers.wrap(onebit_adam.OnebitAdam, "_apply_update", "update (total)")
    timers.wrap(FlatState, "denominator", "  denominator")
    timers.wrap(onebit_adam, "guarded_adam_update_", "  step guard + addcdiv")
    timers.wrap(adam, "guarded_elements", "    step guard: its elements")
    try:
        yield timers
    finally:
        timers.undo()


@contextlib.contextmanager
def _as_before() -> Iterator[None]:
    """The step as it was before the CPU-cost work of issue #12 (same results, bit for bit):
    the step guard's bound recomputed, its indices filtered and its denominator copied from d
    in full every step, its gather/scatter in torch. For side-by-side timing in one process."""
    import commopt.optim.step_guard as step_guard
    from commopt.kernels import TorchKernels, numba_kernels
    from commopt.optim.flat_state import FlatState

    def tiny_variance_in(self: FlatState, ratio: float, start: int, stop: int) -> Any:
        tiny = self.tiny_variance(ratio)
        if tiny is None:
            return None
        where = tiny[(tiny >= start) & (tiny < stop)]
        return where - start if where.numel() else None

    def guard_denominator_base(self: FlatState, d: torch.Tensor) -> torch.Tensor:
        return self.scratch("guarded denominator").copy_(d)

    saved = [
        (step_guard, "adam_step_bound", step_guard.adam_step_bound),
        (FlatState, "tiny_variance_in", FlatState.tiny_variance_in),
        (FlatState, "guard_denominator_base", FlatState.guard_denominator_base),
        (
            numba_kernels.NumbaKernels,
            "guard_denominator_",
            vars(numba_kernels.NumbaKernels)["guard_denominator_"],
        ),
    ]
    reference = TorchKernels()
    step_guard.adam_step_bound = step_guard.adam_step_bound.__wrapped__
    FlatState.tiny_variance_in = tiny_variance_in
    FlatState.guard_denominator_base = guard_denominator_base
    numba_kernels.NumbaKernels.guard_denominator_ = lambda self, *a: reference.guard_denominator_(
        *a
    )
    try:
        yield
    finally:
        for owner, attr, value in saved:
            setattr(owner, attr, value)


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


def _run(steps: int, digest: bool, guard: bool | str, label: str, compare: bool) -> dict:
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
    modes = ("before", "now") if compare else ("now",)
    per_step = {m: collections.defaultdict(list) for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    with _instrumented() as timers:
        for i in range(steps * len(modes)):
            mode = modes[i % len(modes)]  # interleaved: both see the same load
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            timers.totals.clear()
            with _as_before() if mode == "before" else contextlib.nullcontext():
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                opt.step()
                per_step[mode]["step() wall"].append(time.perf_counter() - t0)
                cpu[mode].append(time.process_time() - c0)
            for k, v in timers.totals.items():
                per_step[mode][k].append(v)
    result = {"label": label, "modes": {}}
    for mode in modes:
        cpu_all = [0.0] * n
        cpu_all[rank] = statistics.median(cpu[mode]) * 1e3
        t = torch.tensor(cpu_all, dtype=torch.float64)
        dist.all_reduce(t)
        result["modes"][mode] = {
            "phases_ms": {k: statistics.median(v) * 1e3 for k, v in per_step[mode].items()},
            "cpu_ms_per_rank": t.tolist(),
        }
    digests = [None] * n
    dist.all_gather_object(digests, _state_digest(opt, params) if digest else "")
    result["digests"] = digests
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--digest", action="store_true")
    parser.add_argument("--step-guard", choices=("tiny", "off"), default="tiny")
    parser.add_argument("--label", default="")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="interleave steps as before the issue #12 CPU work (same results) for side-by-side",
    )
    args = parser.parse_args(argv)
    guard: bool | str = False if args.step_guard == "off" else "tiny"
    r = launch(_run, args.world_size, args.steps, args.digest, guard, args.label, args.compare)
    if r is None:
        return 0
    machine = describe_machine()
    print(f"# {args.label} OnebitAdam compression step, {args.world_size} ranks; {machine}")
    modes = list(r["modes"])
    print("| phase (rank 0, ms/step, median) | " + " | ".join(modes) + " |")
    print("|---|" + "---|" * len(modes))
    for k in r["modes"][modes[0]]["phases_ms"]:
        row = [r["modes"][m]["phases_ms"].get(k, 0.0) for m in modes]
        print(f"| {k} | " + " | ".join(f"{v:.1f}" for v in row) + " |")
    cpus = [", ".join(f"{c:.0f}" for c in r["modes"][m]["cpu_ms_per_rank"]) for m in modes]
    print("| CPU ms/step per rank | " + " | ".join(cpus) + " |")
    if args.digest:
        print("digest", " ".join(r["digests"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
