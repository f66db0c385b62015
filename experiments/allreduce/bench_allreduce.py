r"""Benchmark (not a test): ``commopt.compressed_allreduce`` next to dense all_reduce, same run.

For one buffer of ``--numel`` fp32 elements (default 16M = 64 MB) on every rank, times in the
same process group, interleaved round by round so that machine noise hits every method alike:

- ``compressed``: ``commopt.compressed_allreduce`` (SPEC §1, persistent error buffers) with
  the device's default per-element kernels (numba on CPU when installed), unpipelined
  (``pipeline=1``);
- ``pipelined``: the same call in stages (``commopt.pipelined``; ``--stages``, default the
  library's choice for the size), its own error buffers;
- ``compressed_torch``: the same call forced onto the reference ``TorchKernels`` (its own error
  buffers), to compare kernel implementations in the same run;
- ``fp32``: dense ``torch.distributed.all_reduce`` of the fp32 buffer (gloo ring on CPU);
- ``fp16``: the same on an fp16 copy (cast included: that is what a user would pay);
- always, as a yardstick of how busy the machine is: a plain copy of the buffer on every rank
  at once, no communication (about 7 ms for 64 MB on an idle machine of this kind).

Each timed call is bracketed by barriers; the time of a call is the slowest rank's, and the
figure printed is the median over ``--reps`` rounds after ``--warmup`` untimed rounds.

Launch it like training (``commopt.init()`` reads either environment)::

    torchrun --nproc_per_node=4 experiments/allreduce/bench_allreduce.py
    mpiexec -n 4 python experiments/allreduce/bench_allreduce.py
    bash experiments/allreduce/netlab.sh 1gbit         # as root: 4 hosts on an emulated link

``--methods`` picks a subset of ``compressed,pipelined,compressed_torch,fp32,fp16`` (default:
all). ``--profile`` also times the phases of the unpipelined call (SPEC §1 steps; each phase
bracketed by barriers, slowest rank, median) and prints where the time goes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import commopt
from commopt.compressed import compression_bytes
from commopt.kernels import TorchKernels, get_kernels, use_kernels
from commopt.pipelined import auto_stages, stage_ranges

__all__ = ["main"]

_METHODS = ["compressed", "pipelined", "compressed_torch", "fp32", "fp16"]
_COMPRESSED = ("compressed", "pipelined", "compressed_torch")
# How loaded the machine is right now: a copy of the buffer on every rank at once (no
# communication). On an idle machine of this kind one 64 MB copy takes about 7 ms.
_YARDSTICK = "memcpy (no comm)"


def _describe_machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    try:
        load = "load avg " + " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        load = "load avg n/a"
    return (
        f"{socket.gethostname()}: {cpu}, {os.cpu_count()} logical CPUs, {load}; "
        f"torch {torch.__version__}, python {platform.python_version()}"
    )


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds of the slowest rank, mean CPU seconds per rank) for one call of ``fn``.

    All ranks start together. CPU time is this process's, all threads (gloo's too): on a shared
    machine it leaves out the time slices other jobs took, so it tells what the call costs in
    computation when the wall time is inflated by contention.
    """
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)
    return float(wall), float(cpu) / dist.get_world_size()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=16 * 2**20, help="fp32 elements per rank")
    parser.add_argument("--reps", type=int, default=5, help="timed rounds (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--methods", default=",".join(_METHODS), help=f"subset of {_METHODS}")
    parser.add_argument("--label", default="", help="free text printed with the results")
    parser.add_argument("--json", default="", help="also write the results here (rank 0)")
    parser.add_argument(
        "--stages", type=int, default=None, help="stages of 'pipelined' (default: automatic)"
    )
    parser.add_argument(
        "--extra-stages",
        default="",
        help="comma-separated stage counts, each timed as one more method 'pipelined-K'",
    )
    parser.add_argument("--profile", action="store_true", help="time the phases as well")
    args = parser.parse_args(argv)
    chosen = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in chosen if m not in _METHODS]
    if bad:
        parser.error(f"unknown method(s) {bad}; choose from {_METHODS}")

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    backend = commopt.init(timeout=600.0)
    rank, n = backend.rank, backend.world_size
    if n < 2:
        print("bench_allreduce needs at least 2 ranks (torchrun or mpiexec)", file=sys.stderr)
        return 2

    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(args.numel, generator=gen)
    padded = commopt.padded_size(args.numel, n)
    errors = {m: (torch.zeros(padded), torch.zeros(padded // n)) for m in _COMPRESSED}
    out = torch.empty_like(x)
    dense = torch.empty_like(x)
    reference = TorchKernels()

    def compressed() -> None:
        commopt.compressed_allreduce(x, *errors["compressed"], backend, out=out, pipeline=1)

    def pipelined() -> None:
        commopt.compressed_allreduce(
            x, *errors["pipelined"], backend, out=out, pipeline=args.stages
        )

    def compressed_torch() -> None:
        with use_kernels(reference):
            commopt.compressed_allreduce(
                x, *errors["compressed_torch"], backend, out=out, pipeline=1
            )

    def fp32() -> None:
        dense.copy_(x)
        dist.all_reduce(dense)

    def fp16() -> None:
        h = x.to(torch.float16)
        dist.all_reduce(h)
        dense.copy_(h)

    def memcpy() -> None:
        out.copy_(x)

    methods = {"compressed": compressed, "pipelined": pipelined}
    for k in [int(v) for v in args.extra_stages.split(",") if v.strip()]:
        name = f"pipelined-{k}"
        errors[name] = (torch.zeros(padded), torch.zeros(padded // n))
        chosen.append(name)

        def staged(name: str = name, k: int = k) -> None:
            commopt.compressed_allreduce(x, *errors[name], backend, out=out, pipeline=k)

        methods[name] = staged
    methods |= {"compressed_torch": compressed_torch}
    methods |= {"fp32": fp32, "fp16": fp16, _YARDSTICK: memcpy}
    times: dict[str, list[float]] = {m: [] for m in [*chosen, _YARDSTICK]}
    cpu_times: dict[str, list[float]] = {m: [] for m in times}
    for i in range(args.warmup + args.reps):
        for m in times:
            wall, cpu = _timed(methods[m])
            if i >= args.warmup:
                times[m].append(wall)
                cpu_times[m].append(cpu)

    phases = _profile(x, backend, args.reps) if args.profile else {}
    if rank == 0:
        _report(args, times, cpu_times, backend, get_kernels(x.device).name)
        stages = args.stages or auto_stages(padded, n)
        print(f"'pipelined' ran {len(stage_ranges(padded // n, stages))} stages")
        if phases:
            _report_phases(phases, med_total=statistics.median(times.get("compressed", [0.0])))
    commopt.destroy_process_group()
    return 0


def _profile(x: torch.Tensor, backend: commopt.Backend, reps: int) -> dict[str, float]:
    """Median wall time of each phase of an unpipelined call (SPEC §1 steps), slowest rank;
    every phase is bracketed by barriers, so the phases add up to more than one call."""
    n = backend.world_size
    padded = commopt.padded_size(x.numel(), n)
    e, f = torch.zeros(padded), torch.zeros(padded // n)
    kernels = get_kernels(x.device)
    y = torch.empty_like(x)
    bits = torch.empty(padded // 8, dtype=torch.uint8)
    recv = torch.empty(n, padded // (8 * n), dtype=torch.uint8)
    sbits = torch.empty(padded // (8 * n), dtype=torch.uint8)
    scales = torch.empty(n)
    st: dict[str, torch.Tensor] = {}
    phases: list[tuple[str, Callable[[], object]]] = [
        ("1-2 scale (kernel)", lambda: st.update(s=kernels.scale(x, e))),
        ("3 agree (all-gather s, L)", lambda: st.update(ws=_agreement(backend, st["s"]))),
        ("4 pack (kernel)", lambda: kernels.pack_compensated_(x, st["s"], e, bits)),
        ("5 all-to-all signs", lambda: backend.all_to_all(recv, bits.view(n, -1))),
        (
            "6-7 server (kernel)",
            lambda: st.update(t=kernels.server_reduce_(recv, st["ws"], f, sbits)),
        ),
        ("8 all-gather signs", lambda: backend.all_gather(recv, sbits)),
        ("8 all-gather scales", lambda: backend.all_gather(scales, st["t"].reshape(1))),
        ("9 unpack (kernel)", lambda: kernels.unpack_scaled_(recv, scales, y)),
    ]
    samples: dict[str, list[float]] = {name: [] for name, _ in phases}
    for _ in range(reps + 1):
        for name, fn in phases:
            samples[name].append(_timed(fn)[0])
    return {k: statistics.median(v[1:]) for k, v in samples.items()}


def _agreement(backend: commopt.Backend, s: torch.Tensor) -> torch.Tensor:
    """Step 3's traffic and host read as the library has them: an all-gather of 4 floats per
    rank (s, the length in two parts, the overflow flag), read on the host; returns the n scales.
    The library's checks of what it gathered are left out (a few comparisons on n rows)."""
    n = backend.world_size
    meta = torch.zeros(4, dtype=torch.float32, device=s.device)
    meta[0] = s[0]
    gathered = torch.empty(4 * n, dtype=torch.float32, device=s.device)
    backend.all_gather(gathered, meta)
    gathered.cpu()  # the library reads the gathered table on the host to check it
    return gathered.view(n, 4)[:, 0].contiguous()


def _report_phases(phases: dict[str, float], med_total: float) -> None:
    total = sum(phases.values())
    print(f"phases of one unpipelined call (each between barriers; sum {total * 1e3:.1f} ms,")
    print(f"the call itself {med_total * 1e3:.1f} ms):")
    for name, sec in phases.items():
        print(f"  {name:<28} {sec * 1e3:8.1f} ms  {100 * sec / total:5.1f} %")


def _report(
    args: argparse.Namespace,
    times: dict[str, list[float]],
    cpu_times: dict[str, list[float]],
    backend: commopt.Backend,
    kernel_name: str,
) -> None:
    n = backend.world_size
    mb = args.numel * 4 / 1e6
    dense = 2 * (n - 1) * args.numel * 4 // n
    wire = {"fp32": dense, "fp16": dense // 2, _YARDSTICK: 0}
    for c in times:
        if c in _COMPRESSED or c.startswith("pipelined-"):
            wire[c] = compression_bytes(args.numel, n)
    med = {m: statistics.median(v) for m, v in times.items()}
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"bench_allreduce {now:%Y-%m-%d %H:%M} UTC {args.label}".rstrip())
    print(f"machine: {_describe_machine()}")
    print(
        f"{n} ranks ({backend!r}, MASTER_ADDR={os.environ.get('MASTER_ADDR', 'via MPI')}), "
        f"{args.numel:,} fp32 elements = {mb:.1f} MB per rank; 'compressed' uses the "
        f"{kernel_name!r} kernels, 'compressed_torch' TorchKernels; median of {args.reps} "
        f"after {args.warmup} warm-up rounds, each call timed on the slowest rank"
    )
    print(
        f"| {'method':<16} | median ms | min ms | max ms | CPU ms/rank | MB sent/rank "
        "| GB/s algbw |"
    )
    print(
        "|------------------|-----------|--------|--------|-------------|--------------"
        "|------------|"
    )
    for m in times:
        v = times[m]
        cpu = statistics.median(cpu_times[m])
        print(
            f"| {m:<16} | {med[m] * 1e3:9.1f} | {min(v) * 1e3:6.1f} | {max(v) * 1e3:6.1f} "
            f"| {cpu * 1e3:11.1f} | {wire[m] / 1e6:12.2f} | {mb / 1e3 / med[m]:10.3f} |"
        )
    print(
        "CPU ms/rank: median over rounds of the mean over ranks of process CPU time per call "
        "(excludes time slices taken by other jobs)"
    )
    if "compressed" in med and "pipelined" in med:
        print(f"speed-up of pipelined over compressed: {med['compressed'] / med['pipelined']:.2f}x")
    for c in [m for m in times if m in _COMPRESSED or m.startswith("pipelined-")]:
        for m in ("fp32", "fp16"):
            if c in med and m in med:
                print(f"speed-up of {c} over dense {m}: {med[m] / med[c]:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            record = {"label": args.label, "machine": _describe_machine(), "world_size": n}
            record |= {"numel": args.numel, "kernels": kernel_name, "times_s": times}
            record |= {"cpu_s": cpu_times}
            json.dump(record | {"median_s": med}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
