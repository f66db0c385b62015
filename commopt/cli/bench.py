"""``commopt bench``: every collective on every backend, side by side.

::

    mpirun -n 4 commopt bench --max-bytes 16M --csv bench.csv --plot bench.png
    mpirun -n 4 commopt bench --table table.json      # adds a "mixed" column
    mpirun -n 4 commopt bench --table table.json --workload onebit_adam --numel 8M

Per operation and size it prints, for each backend, the time per call (median over repetitions
of the slowest rank), the algorithm bandwidth ``size / time`` and the bus bandwidth ``bytes one
rank sends / time`` under the cost model of :mod:`commopt.comm.base` (for all_reduce,
all_gather and all_to_all this is nccl-tests' busbw). Dense all_reduce runs in float32 and the
half types next to the 1-bit compressed allreduce, whose size is that of its fp32 buffer and
whose bus bandwidth counts the bits it really sends (SPEC §7); a last block gives the speed-up
of the compressed call over the dense float32 one.

``--workload onebit_adam`` instead times OnebitAdam steps (warmup, then compression) on a
synthetic model through each backend and checks that all end with the same parameters.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from commopt.cli import _measure as m
from commopt.comm import Backend, MixedBackend
from commopt.comm.table import dtype_name
from commopt.compressed import compressed_allreduce

__all__ = ["HELP", "add_arguments", "main", "run", "run_workload"]

HELP = "time, algorithm and bus bandwidth of every collective on every backend"
_HALF = ("float16", "bfloat16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``commopt bench`` options."""
    m.add_sweep_arguments(p, default_factor=4)
    p.add_argument(
        "--half-dtypes",
        type=lambda s: m.parse_list(s, (*_HALF, "none"), "--half-dtypes"),
        default=list(_HALF),
        help="half dtypes all_reduce is also measured in (float16,bfloat16; 'none' for none)",
    )
    p.add_argument("--table", default=None, help="selection table: add a 'mixed' backend column")
    p.add_argument("--csv", default=None, help="also write one row per (op, dtype, size, backend)")
    p.add_argument("--plot", default=None, help="PNG: time vs size, one line per backend per op")
    p.add_argument(
        "--workload",
        choices=("onebit_adam",),
        default=None,
        help="time optimizer steps instead of single collectives",
    )
    p.add_argument("--numel", type=m.parse_bytes, default=4 << 20, help="workload: parameters (4M)")
    p.add_argument("--steps", type=m.count(2), default=20, help="workload: steps (20)")
    p.add_argument("--freeze-step", type=m.count(1), default=10, help="workload: warmup steps (10)")


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def _points(ops: Sequence[str], halves: Sequence[str]) -> list[tuple[str, torch.dtype]]:
    pts = []
    for op in ops:
        pts.append((op, torch.float32))
        if op == "all_reduce":
            pts += [(op, getattr(torch, d)) for d in halves if d != "none"]
    return pts


def _backends(args: argparse.Namespace) -> dict[str, Backend]:
    backends = m.start_backends(args.backends)
    if backends and args.table:
        backends["mixed"] = MixedBackend(dict(backends), args.table)
    return backends


def run(args: argparse.Namespace) -> int:
    """Measure each operation at each size on the running backend(s); print the table."""
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (checked before minutes of measuring, not after)
        except ImportError:
            print(
                "commopt bench: --plot needs matplotlib: pip install 'commopt[experiments]'",
                file=sys.stderr,
            )
            return 2
    backends = _backends(args)
    if not backends:
        return m.no_backend("bench")
    first = next(iter(backends.values()))
    if args.workload:
        return run_workload(args, backends)
    rank, n = first.rank, first.world_size
    sizes = m.size_range(args.min_bytes, args.max_bytes, args.factor)
    points = _points(args.ops, args.half_dtypes)
    rows: list[dict[str, Any]] = []
    bar = m.progress(len(points) * len(sizes) * len(backends), rank, not args.no_progress, "bench")
    for op, dtype in points:
        for size in sizes:
            case = m.make_case(op, size, dtype, n)
            for name, be in backends.items():
                bar.set_postfix_str(f"{op}/{dtype_name(dtype)} {m.human_bytes(size)} {name}")
                t = m.time_case(be, case, args.reps, args.warmup)
                rows.append(
                    {
                        "op": op,
                        "dtype": dtype_name(dtype),
                        "bytes": case.nbytes,
                        "backend": name,
                        "seconds": t,
                        "algbw_GBps": _gbps(case.nbytes, t),
                        "busbw_GBps": _gbps(case.model_bytes, t),
                    }
                )
                bar.update()
            del case
    bar.close()
    hosts = _host_count(first)
    if rank == 0:
        print(report(rows, list(backends), n, hosts))
        if args.csv:
            with open(args.csv, "w", newline="", encoding="utf-8") as f:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
            print(f"wrote {args.csv}")
        if args.plot:
            plot(rows, args.plot, n)
            print(f"wrote {args.plot}")
    first.barrier()
    return 0


def _host_count(be: Backend) -> int:
    """How many different hosts the ranks run on (one small all-gather of hostname hashes)."""
    import socket
    import zlib

    mine = torch.tensor([zlib.crc32(socket.gethostname().encode())], dtype=torch.int64)
    everyone = torch.empty(be.world_size, dtype=torch.int64)
    be.all_gather(everyone, mine)
    return len(set(everyone.tolist()))


ONE_HOST_NOTE = (
    "note: every rank runs on this one host, so these collectives cross loopback or shared "
    "memory, not a network; the per-element CPU work dominates and the speed-ups above say "
    "nothing about a cluster. Measure between hosts, or on an emulated slow link "
    "(docs/performance.md)."
)


def report(
    rows: Sequence[Mapping[str, Any]], names: Sequence[str], world_size: int, hosts: int = 0
) -> str:
    """The side-by-side text table, then the compressed-vs-dense speed-ups (and, when every
    rank ran on one host, ``hosts == 1``, a note that they are not network figures)."""
    import socket

    out = [
        f"commopt bench: {world_size} ranks on {socket.gethostname()}; time per call = median of "
        "the slowest rank; algbw = size/time; busbw = modelled bytes sent per rank/time (GB/s)"
    ]
    head = f"{'size':>9} " + " ".join(f"| {n:^30}" for n in names)
    sub = f"{'':>9} " + " ".join(f"| {'ms':>9} {'algbw':>9} {'busbw':>9}" for _ in names)
    by_key: dict[tuple[str, str], dict[int, dict[str, Mapping[str, Any]]]] = {}
    for r in rows:
        by_key.setdefault((r["op"], r["dtype"]), {}).setdefault(r["bytes"], {})[r["backend"]] = r
    for (op, dtype), per_size in by_key.items():
        out += ["", f"{op} ({dtype})", head, sub]
        for size, cells in per_size.items():
            parts = []
            for name in names:
                c = cells.get(name)
                parts.append(
                    f"| {c['seconds'] * 1e3:9.3f} {c['algbw_GBps']:9.3g} {c['busbw_GBps']:9.3g}"
                    if c
                    else f"| {'-':>9} {'-':>9} {'-':>9}"
                )
            out.append(f"{m.human_bytes(size):>9} " + " ".join(parts))
    dense = by_key.get(("all_reduce", "float32"), {})
    comp = by_key.get(("compressed_allreduce", "float32"), {})
    common = [s for s in comp if s in dense]
    if common:
        out += ["", "speed-up of compressed_allreduce over dense float32 all_reduce (same backend)"]
        out.append(f"{'size':>9} " + " ".join(f"| {n:>9}" for n in names))
        for size in common:
            parts = []
            for name in names:
                d, c = dense[size].get(name), comp[size].get(name)
                parts.append(f"| {d['seconds'] / c['seconds']:8.2f}x" if d and c else f"| {'-':>9}")
            out.append(f"{m.human_bytes(size):>9} " + " ".join(parts))
        if hosts == 1:
            out += ["", ONE_HOST_NOTE]
    return "\n".join(out)


def plot(rows: Sequence[Mapping[str, Any]], path: str, world_size: int) -> None:
    """Time vs size (log-log), one panel per operation, one line per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((r["op"], r["dtype"]) for r in rows))
    cols = min(3, len(keys))
    nrows = -(-len(keys) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
    for ax, (op, dtype) in zip(axes.flat, keys, strict=False):
        sel = [r for r in rows if (r["op"], r["dtype"]) == (op, dtype)]
        for name in dict.fromkeys(r["backend"] for r in sel):
            pts = [(r["bytes"], r["seconds"]) for r in sel if r["backend"] == name]
            ax.loglog([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker="o", ms=3, label=name)
        ax.set_title(f"{op} ({dtype}), {world_size} ranks")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("time per call (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    for ax in list(axes.flat)[len(keys) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _synthetic_shapes(numel: int) -> list[tuple[int, ...]]:
    """A model-like mix: a few large matrices and many small vectors, ``numel`` in total."""
    big = [numel * 4 // 10, numel * 3 // 10, numel * 2 // 10]
    small = numel - sum(big)
    shapes: list[tuple[int, ...]] = [(b,) for b in big if b]
    k = 16
    shapes += [(small // k,) for _ in range(k - 1) if small // k]
    shapes.append((small - (k - 1) * (small // k),))
    return [s for s in shapes if s[0] > 0]


def run_workload(args: argparse.Namespace, backends: Mapping[str, Backend]) -> int:
    """Time OnebitAdam steps through each backend; all must end with the same parameters."""
    from commopt.optim import OnebitAdam

    if not 1 <= args.freeze_step < args.steps:
        raise ValueError(
            f"--freeze-step must be in [1, --steps), got {args.freeze_step} with --steps "
            f"{args.steps}: the workload needs both warmup and compression steps"
        )
    first = next(iter(backends.values()))
    rank = first.rank
    shapes = _synthetic_shapes(args.numel)
    results: dict[str, dict[str, Any]] = {}
    finals: dict[str, list[torch.Tensor]] = {}
    params = {b: [torch.nn.Parameter(torch.zeros(s)) for s in shapes] for b in backends}
    opts = {
        b: OnebitAdam(params[b], lr=1e-3, freeze_step=args.freeze_step, backend=be)
        for b, be in backends.items()
    }
    calls = dict.fromkeys(backends, 0)
    times = {b: torch.zeros(args.steps, dtype=torch.float64) for b in backends}
    # One-time costs (a JIT compile of the CPU kernels) must not land on whichever backend
    # happens to run the first compressed step: pay them here, untimed.
    _x = torch.ones(8 * first.world_size)
    _e = torch.zeros(_x.numel())
    compressed_allreduce(_x, _e, torch.zeros(8), first)
    bar = m.progress(len(backends) * args.steps, rank, not args.no_progress, "onebit_adam")
    for step in range(args.steps):
        # Interleaved: step k runs on every backend before step k+1, so drift in the machine's
        # load hits all of them alike, in an order rotated every step, so that no backend always
        # runs first or last. Same gradients for every backend.
        gen = torch.Generator().manual_seed(1000 * step + rank)
        grads = [torch.randn(s, generator=gen) for s in shapes]
        names = list(backends)
        for name in names[step % len(names) :] + names[: step % len(names)]:
            be = backends[name]
            for p, g in zip(params[name], grads, strict=True):
                p.grad = g.clone()
            be.barrier()
            c0 = be.stats.calls
            t0 = time.perf_counter()
            opts[name].step()
            times[name][step] = time.perf_counter() - t0
            calls[name] += be.stats.calls - c0
            bar.update()
    for name, be in backends.items():
        be.all_reduce(times[name], "max")
        t = times[name].tolist()
        # step 1 also lays out buckets and checks the model: left out of the medians
        warm, comp = t[1 : args.freeze_step], t[args.freeze_step :]
        # steady: without the first step of each phase (bucket layout, error-buffer allocation)
        steady = sum(t) - t[0] - t[args.freeze_step]
        results[name] = {
            "total_s": round(sum(t), 3),
            "steady_s": round(steady, 3),
            "warmup_step_ms": round(statistics.median(warm) * 1e3, 2) if warm else float("nan"),
            "compressed_step_ms": round(statistics.median(comp) * 1e3, 2),
            "calls": calls[name],
        }
        if isinstance(be, MixedBackend):
            results[name]["routes"] = dict(be.calls_by_backend)
            results[name]["switches"] = be.switches
        finals[name] = [p.detach().clone() for p in params[name]]
    bar.close()
    ref_name = next(iter(finals))
    for name, ps in finals.items():
        results[name]["max_abs_diff_vs_" + ref_name] = max(
            float((a - b).abs().max()) for a, b in zip(ps, finals[ref_name], strict=True)
        )
    if rank == 0:
        print(
            f"OnebitAdam workload: {args.numel} parameters in {len(shapes)} tensors, "
            f"{args.steps} steps ({args.freeze_step} warmup), {first.world_size} ranks"
        )
        best = min((r["steady_s"], n) for n, r in results.items() if n != "mixed")
        for name, r in results.items():
            extra = ""
            if name == "mixed":
                extra = f"  (steady: {best[0] / r['steady_s']:.2f}x vs best single {best[1]})"
            print(f"  {name:>6}: " + ", ".join(f"{k}={v}" for k, v in r.items()) + extra)
    first.barrier()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m commopt.cli.bench``."""
    p = argparse.ArgumentParser(prog="commopt bench", description=HELP)
    add_arguments(p)
    return run(p.parse_args(argv))
