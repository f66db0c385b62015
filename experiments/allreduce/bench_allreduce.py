r"""Benchmark (not a test): ``commopt.compressed_allreduce`` next to dense all_reduce, same run.

For one buffer of ``--numel`` fp32 elements (default 16M = 64 MB) on every rank, times in the
same process group, interleaved round by round so that machine noise hits every method alike:

- ``compressed``: ``commopt.compressed_allreduce`` (SPEC §1, persistent error buffers);
- ``dense fp32``: ``torch.distributed.all_reduce`` of the fp32 buffer (gloo ring on CPU);
- ``dense fp16``: the same on an fp16 copy (cast included: that is what a user would pay).

Each timed call is bracketed by barriers; the time of a call is the slowest rank's, and the
figure printed is the median over ``--reps`` rounds after ``--warmup`` untimed rounds.

Launch it like training (``commopt.init()`` reads either environment)::

    torchrun --nproc_per_node=4 experiments/allreduce/bench_allreduce.py
    mpiexec -n 4 python experiments/allreduce/bench_allreduce.py
    bash experiments/allreduce/netlab.sh 1gbit         # as root: 4 hosts on an emulated link

``--kernels torch`` forces the reference per-element path (``TorchKernels``) instead of the
default for the device, to compare kernel implementations.
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

__all__ = ["main"]


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


def _timed(fn: Callable[[], object]) -> float:
    """Seconds the slowest rank spent in ``fn`` (all ranks start together)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=16 * 2**20, help="fp32 elements per rank")
    parser.add_argument("--reps", type=int, default=7, help="timed rounds (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument(
        "--methods", default="compressed,fp32,fp16", help="subset of compressed,fp32,fp16"
    )
    parser.add_argument(
        "--kernels",
        choices=("default", "torch"),
        default="default",
        help="per-element path of the compressed call: the device default or TorchKernels",
    )
    parser.add_argument("--label", default="", help="free text printed with the results")
    parser.add_argument("--json", default="", help="also write the results here (rank 0)")
    args = parser.parse_args(argv)

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    backend = commopt.init(timeout=600.0)
    rank, n = backend.rank, backend.world_size
    if n < 2:
        print("bench_allreduce needs at least 2 ranks (torchrun or mpiexec)", file=sys.stderr)
        return 2

    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(args.numel, generator=gen)
    padded = commopt.padded_size(args.numel, n)
    worker_error = torch.zeros(padded)
    server_error = torch.zeros(padded // n)
    out = torch.empty_like(x)
    dense = torch.empty_like(x)

    def compressed() -> None:
        commopt.compressed_allreduce(x, worker_error, server_error, backend, out=out)

    def fp32() -> None:
        dense.copy_(x)
        dist.all_reduce(dense)

    def fp16() -> None:
        h = x.to(torch.float16)
        dist.all_reduce(h)
        dense.copy_(h)

    methods = {"compressed": compressed, "fp32": fp32, "fp16": fp16}
    chosen = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in chosen if m not in methods]
    if bad:
        parser.error(f"unknown method(s) {bad}; choose from {list(methods)}")

    kernel_ctx = (
        use_kernels(TorchKernels()) if args.kernels == "torch" else contextlib.nullcontext()
    )
    times: dict[str, list[float]] = {m: [] for m in chosen}
    with kernel_ctx:
        kernel_name = get_kernels(x.device).name
        for i in range(args.warmup + args.reps):
            for m in chosen:
                t = _timed(methods[m])
                if i >= args.warmup:
                    times[m].append(t)

    if rank == 0:
        mb = args.numel * 4 / 1e6
        wire = {
            "compressed": compression_bytes(args.numel, n),
            "fp32": 2 * (n - 1) * args.numel * 4 // n,
            "fp16": 2 * (n - 1) * args.numel * 2 // n,
        }
        med = {m: statistics.median(v) for m, v in times.items()}
        print(
            f"bench_allreduce {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
            f" {args.label}".rstrip()
        )
        print(f"machine: {_describe_machine()}")
        print(
            f"{n} ranks ({backend!r}, MASTER_ADDR={os.environ.get('MASTER_ADDR', 'via MPI')}), "
            f"{args.numel:,} fp32 elements = {mb:.1f} MB per rank, compressed kernels: "
            f"{kernel_name}; median of {args.reps} after {args.warmup} warm-up rounds "
            "(slowest rank per call)"
        )
        print(f"| {'method':<10} | median ms | min ms | max ms | MB sent/rank | GB/s algbw |")
        print("|------------|-----------|--------|--------|--------------|------------|")
        for m in chosen:
            v = times[m]
            print(
                f"| {m:<10} | {med[m] * 1e3:9.1f} | {min(v) * 1e3:6.1f} | {max(v) * 1e3:6.1f} "
                f"| {wire[m] / 1e6:12.2f} | {mb / 1e3 / med[m]:10.3f} |"
            )
        if "compressed" in med:
            for m in ("fp32", "fp16"):
                if m in med:
                    print(
                        f"speed-up of compressed over dense {m}: {med[m] / med['compressed']:.2f}x"
                    )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "label": args.label,
                        "machine": _describe_machine(),
                        "world_size": n,
                        "numel": args.numel,
                        "kernels": kernel_name,
                        "times_s": times,
                        "median_s": med,
                    },
                    f,
                    indent=1,
                )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
