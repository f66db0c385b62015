r"""Per-rank CPU cost of the compressed allreduce's per-element work, in memcpy-equivalents.

One rank's share of SPEC §1 for a buffer of N fp32 elements at world size n is, as
:func:`commopt.compressed_allreduce` calls the kernels,

    scale (N) + pack_compensated_ (N) + server_reduce_ (n rows of N/n) + unpack_scaled_ (N);

no communication is involved: the received rows are random bytes with the right shapes. The
yardstick is one memcpy of the same N·4 bytes (``np.copyto`` into a buffer already touched),
timed in the same run and interleaved with the kernels, so a busy machine slows both alike.
Each kernel set runs in turn, round after round, and medians are reported, on two clocks: the
process's CPU time (what this rank itself spent; robust on a shared machine, the headline) and
wall time.

Variants timed:

- ``torch``: :class:`commopt.kernels.TorchKernels`, the reference (torch limited to one thread,
  as one of several ranks sharing the cores).
- ``numba``: :class:`commopt.kernels.numba_kernels.NumbaKernels`, the path above.
- ``numba, stored c``: the same kernels with the worker side done the other way the interface
  allows, ``compensate`` (writes c, a preallocated 4N-byte buffer) + ``pack_worker_`` (reads it).

It also times the numba kernels' first call in ``--compile-ranks`` fresh processes started
together (as ranks are), twice: with an empty cache (every process compiles) and again with the
cache those runs left (every process loads the machine code from disk).

Usage::

    python experiments/kernels/bench_cpu_kernels.py [--numel 16777216] [--world-size 4]
        [--rounds 7] [--compile-ranks 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from commopt.compressed import padded_size
from commopt.kernels import TorchKernels

__all__ = ["main"]

STAGES = ("scale", "pack_compensated_", "server_reduce_", "unpack_scaled_", "total")


def _clock() -> tuple[float, float]:
    return time.process_time(), time.perf_counter()


def _elapsed(t0: tuple[float, float], t1: tuple[float, float]) -> tuple[float, float]:
    return t1[0] - t0[0], t1[1] - t0[1]


def _per_element_work(kernels, bufs: dict, stored_c: bool) -> dict[str, tuple[float, float]]:
    """One rank's per-element work; (cpu, wall) seconds per stage."""
    t0 = _clock()
    if stored_c:
        s = kernels.compensate(bufs["x"], bufs["e"], bufs["c"])
    else:
        s = kernels.scale(bufs["x"], bufs["e"])
    t1 = _clock()
    if stored_c:
        kernels.pack_worker_(bufs["c"], s, bufs["e"], bufs["bits"])
    else:
        kernels.pack_compensated_(bufs["x"], s, bufs["e"], bufs["bits"])
    t2 = _clock()
    kernels.server_reduce_(bufs["recv"], bufs["scales"], bufs["f"], bufs["server_bits"])
    t3 = _clock()
    kernels.unpack_scaled_(bufs["recv"], bufs["server_scales"], bufs["out"])
    t4 = _clock()
    return dict(
        zip(
            STAGES,
            (
                _elapsed(t0, t1),
                _elapsed(t1, t2),
                _elapsed(t2, t3),
                _elapsed(t3, t4),
                _elapsed(t0, t4),
            ),
            strict=True,
        )
    )


def _buffers(numel: int, n: int, seed: int = 0) -> dict:
    padded = padded_size(numel, n)
    chunk = padded // n
    rng = np.random.default_rng(seed)
    return {
        "x": torch.from_numpy(rng.standard_normal(numel, dtype=np.float32)),
        "e": torch.from_numpy(rng.standard_normal(padded, dtype=np.float32) * np.float32(0.01)),
        "f": torch.from_numpy(rng.standard_normal(chunk, dtype=np.float32) * np.float32(0.01)),
        "c": torch.zeros(padded),
        "recv": torch.from_numpy(rng.integers(0, 256, (n, chunk // 8), dtype=np.uint8)),
        "scales": torch.from_numpy(rng.random(n, dtype=np.float32) + np.float32(0.5)),
        "server_scales": torch.from_numpy(rng.random(n, dtype=np.float32) + np.float32(0.5)),
        "bits": torch.zeros(padded // 8, dtype=torch.uint8),
        "server_bits": torch.zeros(chunk // 8, dtype=torch.uint8),
        "out": torch.zeros(numel),
    }


_FIRST_CALL = """
import time
t0 = time.perf_counter()
import torch
from commopt.kernels.numba_kernels import NumbaKernels
t1 = time.perf_counter()
c1 = time.process_time()
k = NumbaKernels()
x, e, f = torch.randn(100), torch.zeros(128), torch.zeros(32)
bits, sbits = torch.empty(16, dtype=torch.uint8), torch.empty(4, dtype=torch.uint8)
s = k.scale(x, e)
k.pack_compensated_(x, s, e, bits)
t = k.server_reduce_(bits.view(4, 4), torch.ones(4), f, sbits)
k.unpack_scaled_(bits.view(4, 4), torch.ones(4), torch.empty(100))
t2 = time.perf_counter()
print(t1 - t0, t2 - t1, time.process_time() - c1)
"""


def _first_calls(ranks: int, cache_dir: str) -> list[tuple[float, float, float]]:
    """(import s, first-call wall s, first-call CPU s) in ``ranks`` processes started together."""
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _FIRST_CALL], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(ranks)
    ]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"first-call probe failed with exit code {p.returncode}")
        imp, first, first_cpu = (float(v) for v in stdout.split())
        out.append((imp, first, first_cpu))
    return out


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--compile-ranks", type=int, default=4, help="0 skips the compile timing")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    n, numel = args.world_size, args.numel

    bufs = _buffers(numel, n)
    e0, f0 = bufs["e"].clone(), bufs["f"].clone()
    src = bufs["x"].numpy()
    dst = np.zeros_like(src)

    def memcpy() -> tuple[float, float]:
        t0 = _clock()
        np.copyto(dst, src)
        return _elapsed(t0, _clock())

    variants: dict[str, tuple[object, bool]] = {"torch": (TorchKernels(), False)}
    first_call = None
    try:
        from commopt.kernels.numba_kernels import NumbaKernels
    except ImportError as exc:
        print(f"numba kernels unavailable ({exc}); timing TorchKernels only")
    else:
        fast = NumbaKernels()
        t0 = time.perf_counter()
        _per_element_work(fast, _buffers(64, n), stored_c=False)  # compile, or load from cache
        _per_element_work(fast, _buffers(64, n), stored_c=True)
        first_call = time.perf_counter() - t0
        variants["numba"] = (fast, False)
        variants["numba, stored c"] = (fast, True)

    samples: dict[str, list[dict]] = {name: [] for name in variants}
    copies = [memcpy()]
    for _ in range(args.rounds):
        for name, (kernels, stored_c) in variants.items():
            bufs["e"].copy_(e0)
            bufs["f"].copy_(f0)
            samples[name].append(_per_element_work(kernels, bufs, stored_c))
            copies.append(memcpy())
    memcpy_cpu = statistics.median(c[0] for c in copies)
    memcpy_wall = statistics.median(c[1] for c in copies)

    result = {
        "machine": f"{_cpu_name()}, {os.cpu_count()} cores, shared with other jobs",
        "numel": numel,
        "world_size": n,
        "rounds": args.rounds,
        "memcpy_ms": {"cpu": memcpy_cpu * 1e3, "wall": memcpy_wall * 1e3},
        "numba_first_call_s": first_call,
        "kernels": {},
    }
    print(f"{result['machine']}; N = {numel}, n = {n}, one thread, {args.rounds} rounds, medians")
    print(
        f"memcpy of {4 * numel / 2**20:.0f} MiB: {memcpy_cpu * 1e3:.2f} ms CPU, "
        f"{memcpy_wall * 1e3:.2f} ms wall "
        f"({8 * numel / memcpy_cpu / 1e9:.1f} GB/s read+write on CPU time)"
    )
    if first_call is not None:
        print(
            f"numba kernels, first call in this process (compile or cache load): {first_call:.2f} s"
        )
    for clock, idx, yard in (("CPU time", 0, memcpy_cpu), ("wall time", 1, memcpy_wall)):
        print(f"\n{clock}: ms | memcpy-equivalents")
        print(f"{'':16s}" + "".join(f"{st:>18s}" for st in STAGES))
        for name, runs in samples.items():
            med = {st: statistics.median(r[st][idx] for r in runs) for st in STAGES}
            result["kernels"].setdefault(name, {})[clock] = {
                st: {"ms": med[st] * 1e3, "memcpy_equiv": med[st] / yard} for st in STAGES
            }
            print(
                f"{name:16s}"
                + "".join(f"{med[st] * 1e3:10.1f} |{med[st] / yard:6.2f}" for st in STAGES)
            )
    if args.compile_ranks and first_call is not None:
        with tempfile.TemporaryDirectory() as cache:
            cold = _first_calls(args.compile_ranks, cache)
            warm = _first_calls(args.compile_ranks, cache)
        result["first_call_s"] = {"cold_cache": cold, "warm_cache": warm}
        ranks = args.compile_ranks
        print(f"\nnumba first call in {ranks} processes started together (s, per process):")
        for label, runs in (("empty cache (compile)", cold), ("cache filled (load)", warm)):
            imports = ", ".join(f"{r[0]:.1f}" for r in runs)
            firsts = ", ".join(f"{r[1]:.1f}" for r in runs)
            cpu = ", ".join(f"{r[2]:.1f}" for r in runs)
            print(
                f"  {label:22s} import torch+numba (wall): {imports}; first call wall: {firsts};"
                f" first call CPU: {cpu}"
            )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return result


if __name__ == "__main__":
    main()
