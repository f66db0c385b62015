r"""Throughput of the CUDA kernels (cuda/*.cu through CuPy) vs the device's copy bandwidth.

For N fp32 elements at world size n, each kernel of ``CupyKernels``
(:mod:`commopt.kernels.cupy_kernels`) moves a known number of bytes (counted below, reads +
writes, each byte once); its throughput is that count over its time, measured with CUDA
events on torch's current stream (median of ``--rounds``). The yardstick is a
device-to-device ``copy_`` of the same 4N bytes (2·4N bytes moved), timed the same way in the
same run. The issue's goal is ≥ 80 % of the copy bandwidth.

Requires a CUDA GPU and CuPy; exits with a message otherwise.

Usage::

    python experiments/kernels/bench_cuda_kernels.py [--numel 16777216] [--world-size 4]
        [--rounds 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from commopt.compressed import padded_size

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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 24)
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
    n, numel = args.world_size, args.numel
    padded = padded_size(numel, n)
    chunk = padded // n
    k = CupyKernels()
    x = torch.randn(numel, device=dev)
    e = torch.randn(padded, device=dev) * 0.01
    c = torch.empty(padded, device=dev)
    f = torch.randn(chunk, device=dev) * 0.01
    bits = torch.empty(padded // 8, dtype=torch.uint8, device=dev)
    recv = torch.randint(0, 256, (n, chunk // 8), dtype=torch.uint8, device=dev)
    scales = torch.rand(n, device=dev) + 0.5
    server_bits = torch.empty(chunk // 8, dtype=torch.uint8, device=dev)
    out = torch.empty(numel, device=dev)
    dst = torch.empty(padded, device=dev)
    s = k.scale(x, e)

    four = 4
    cases = {
        # name: (callable, bytes read + written)
        "copy_ (yardstick)": (lambda: dst.copy_(e), 2 * four * padded),
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
    }
    result = {
        "device": torch.cuda.get_device_name(dev),
        "numel": numel,
        "world_size": n,
        "kernels": {},
    }
    copy_gbps = None
    print(f"{result['device']}; N = {numel}, n = {n}, median of {args.rounds}")
    for name, (fn, nbytes) in cases.items():
        sec = _time(fn, args.rounds)
        gbps = nbytes / sec / 1e9
        copy_gbps = copy_gbps or gbps
        result["kernels"][name] = {"ms": sec * 1e3, "GBps": gbps, "of_copy": gbps / copy_gbps}
        print(
            f"{name:20s} {sec * 1e3:8.3f} ms {gbps:8.1f} GB/s"
            f" {100 * gbps / copy_gbps:6.1f} % of copy"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return result


if __name__ == "__main__":
    main()
