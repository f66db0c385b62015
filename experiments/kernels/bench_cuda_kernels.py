r"""Throughput of the CUDA kernels (cuda/*.cu through CuPy) vs torch and the copy bandwidth.

For N fp32 elements at world size n, each kernel of ``CupyKernels``
(:mod:`commopt.kernels.cupy_kernels`) moves a known number of bytes (counted below, reads +
writes, each byte once); its throughput is that count over its time, measured with CUDA
events on torch's current stream (median of ``--rounds``). Side by side in the same run, on the
same inputs:

- the torch reference (``TorchKernels``: the same operations as plain torch ops);
- the yardstick, a device-to-device ``copy_`` of the same 4N bytes (2·4N bytes moved);
- ``allreduce work``: one rank's whole per-element work of a ``compressed_allreduce`` at world
  size n (scale, pack_compensated_, server_reduce_ on its chunk, unpack_scaled_), back to
  back, without the transfers;
- ``host µs``: wall time of one call with the GPU idle (the launch's cost on the host; the
  goal is ≤ 20 µs).

The goals: ≥ 80 % of copy for the worker kernels and unpack at 16M and 128M,
≥ 60 % for server_reduce_, ≤ 30 µs per kernel at 1M, and the four kernels together ≥ 4× faster
than the torch reference at 16M.

Requires a CUDA GPU and CuPy; exits with a message otherwise.

Usage::

    python experiments/kernels/bench_cuda_kernels.py [--numel 1048576 16777216 134217728]
        [--world-size 4] [--rounds 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from commopt.compressed import padded_size
from commopt.kernels import TorchKernels

__all__ = ["main"]


def _time(fn, rounds: int) -> float:
    """Median seconds of ``fn`` over ``rounds`` runs, timed with events on the current stream."""
    fn()  # compile / warm up
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _host_us(fn, calls: int = 50) -> float:
    """Median wall time of one call, µs, each started with the GPU idle."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def _time_copy(padded: int, rounds: int) -> float:
    src = torch.randn(padded, device="cuda")
    dst = torch.empty_like(src)
    return _time(lambda: dst.copy_(src), rounds)


def _cases(k, numel: int, n: int) -> dict:
    """name -> (callable, bytes read + written) for kernel set ``k`` on fresh inputs."""
    dev = torch.device("cuda")
    padded = padded_size(numel, n)
    chunk = padded // n
    x = torch.randn(numel, device=dev)
    e = torch.randn(padded, device=dev) * 0.01
    c = torch.empty(padded, device=dev)
    f = torch.randn(chunk, device=dev) * 0.01
    bits = torch.empty(padded // 8, dtype=torch.uint8, device=dev)
    recv = torch.randint(0, 256, (n, chunk // 8), dtype=torch.uint8, device=dev)
    scales = torch.rand(n, device=dev) + 0.5
    server_bits = torch.empty(chunk // 8, dtype=torch.uint8, device=dev)
    out = torch.empty(numel, device=dev)
    s = k.scale(x, e)

    def allreduce_work() -> None:
        s_r = k.scale(x, e)
        k.pack_compensated_(x, s_r, e, bits)
        k.server_reduce_(recv, scales, f, server_bits)
        k.unpack_scaled_(recv, scales, out)

    four = 4
    return {
        "scale": (lambda: k.scale(x, e), four * (numel + padded)),
        "pack_compensated_": (
            lambda: k.pack_compensated_(x, s, e, bits),
            four * (numel + 2 * padded) + padded // 8,
        ),
        "compensate": (lambda: k.compensate(x, e, c), four * (numel + 2 * padded)),
        "pack_worker_": (lambda: k.pack_worker_(c, s, e, bits), four * 2 * padded + padded // 8),
        "server_reduce_": (
            lambda: k.server_reduce_(recv, scales, f, server_bits),
            padded // 8 + four * 4 * chunk + chunk // 8,
        ),
        "unpack_scaled_": (lambda: k.unpack_scaled_(recv, scales, out), padded // 8 + four * numel),
        "allreduce work": (allreduce_work, None),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, nargs="+", default=[1 << 20, 1 << 24, 1 << 27])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU visible to torch; nothing to measure")
    try:
        from commopt.kernels.cupy_kernels import CupyKernels
    except ImportError as exc:
        sys.exit(f"CuPy is not installed ({exc}); install the `cuda` extra")

    dev = torch.device("cuda")
    n = args.world_size
    result: dict = {"device": torch.cuda.get_device_name(dev), "world_size": n, "sizes": {}}
    print(f"{result['device']}; n = {n}; CUDA events, median of {args.rounds}")
    for numel in args.numel:
        padded = padded_size(numel, n)
        copy_s = _time_copy(padded, args.rounds)
        copy_gbps = 2 * 4 * padded / copy_s / 1e9
        cupy, ref = _cases(CupyKernels(), numel, n), _cases(TorchKernels(), numel, n)
        rows = {}
        print(f"\nN = {numel:,}: copy_ {copy_s * 1e3:.3f} ms = {copy_gbps:.0f} GB/s (yardstick)")
        print(
            f"{'kernel':18s} {'CuPy ms':>9s} {'% of copy':>9s} {'host µs':>8s}"
            f" {'torch ms':>9s} {'speed-up':>8s}"
        )
        for name, (fn, nbytes) in cupy.items():
            sec, ref_sec = _time(fn, args.rounds), _time(ref[name][0], args.rounds)
            host = _host_us(fn)
            of_copy = nbytes / sec / 1e9 / copy_gbps if nbytes else None
            rows[name] = {
                "ms": sec * 1e3,
                "of_copy": of_copy,
                "host_us": host,
                "torch_ms": ref_sec * 1e3,
                "speedup": ref_sec / sec,
            }
            pct = f"{100 * of_copy:8.1f}%" if of_copy is not None else f"{'-':>9s}"
            print(
                f"{name:18s} {sec * 1e3:9.3f} {pct} {host:8.1f} {ref_sec * 1e3:9.3f}"
                f" {ref_sec / sec:7.2f}x"
            )
        del cupy, ref
        torch.cuda.empty_cache()
        result["sizes"][numel] = {"copy_ms": copy_s * 1e3, "copy_GBps": copy_gbps, "kernels": rows}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return result


if __name__ == "__main__":
    main()
