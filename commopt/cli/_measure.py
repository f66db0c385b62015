"""What ``commopt tune`` and ``commopt bench`` share: sizes, backends, one timed collective.

A timing is taken the way collective benchmarks usually take it: warm-up calls, then for each
repetition a barrier on the measured backend and one timed call; each repetition's time is the
slowest rank's (an all-reduce of ``max``), and the figure reported is the median over the
repetitions. Every rank ends with the same numbers, so decisions drawn from them agree.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from commopt.comm import Backend
from commopt.comm.base import model_bytes
from commopt.compressed import compressed_allreduce, compression_bytes, padded_size

__all__ = [
    "COLLECTIVES",
    "Case",
    "busbw",
    "count",
    "make_case",
    "no_backend",
    "parse_bytes",
    "progress",
    "size_range",
    "start_backends",
    "time_case",
]

#: the operations a case can measure ("compressed_allreduce" takes an fp32 buffer)
COLLECTIVES = ("all_reduce", "all_gather", "all_to_all", "broadcast", "compressed_allreduce")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_bytes(text: str) -> int:
    """``"64MiB"``, ``"64M"``, ``"1k"``, ``"4096"`` → bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(?:i?[bB])?\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: expected an integer with an optional K, M or G suffix "
            "(binary units, e.g. 1KiB, 64M)"
        )
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def count(least: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``least``, or argparse's usage error (exit status 2,
    the same one line on every rank) before any backend starts."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}")
        return value

    return parse


def human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n // scale}{unit}" if n % scale == 0 else f"{n / scale:.1f}{unit}"
    return f"{n}B"


def size_range(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    """``min_bytes, min_bytes·factor, …`` up to ``max_bytes``, which always ends the list."""
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(
            f"size range needs 1 <= --min-bytes <= --max-bytes, got {min_bytes} and {max_bytes}"
        )
    if factor < 2:
        raise ValueError(f"--factor must be an integer >= 2, got {factor}")
    sizes, s = [], min_bytes
    while s < max_bytes:
        sizes.append(s)
        s *= factor
    sizes.append(max_bytes)
    return sizes


def no_backend(tool: str) -> int:
    """Tell the user that ``commopt {tool}`` found no multi-rank backend to measure; returns
    the exit status, 2."""
    print(
        f"commopt {tool}: no multi-rank backend in this process; launch it with mpirun/mpiexec "
        "or torchrun on 2 or more ranks",
        file=sys.stderr,
    )
    return 2


def start_backends(wanted: Sequence[str] | None = None) -> dict[str, Backend]:
    """Every backend this job can use, started if needed: ``torch`` (gloo/NCCL through
    :func:`commopt.init`, or the already initialized default group) and, when an MPI launcher
    started the process, ``mpi``. ``wanted`` restricts the set (an unavailable name is an error).
    """
    import torch.distributed as dist

    import commopt
    from commopt.comm import MpiBackend, TorchBackend
    from commopt.launch import discover_launch, launched_by_mpi

    found: dict[str, Backend] = {}
    want = set(wanted) if wanted else {"torch", "mpi"}
    unknown = want - {"torch", "mpi"}
    if unknown:
        raise ValueError(f"--backends: unknown {sorted(unknown)}; choose from torch, mpi")
    if "torch" in want:
        if dist.is_available() and dist.is_initialized():
            found["torch"] = TorchBackend()
        elif discover_launch().world_size > 1:
            found["torch"] = commopt.init("torch")
    if "mpi" in want and launched_by_mpi():
        found["mpi"] = MpiBackend()
    if wanted:
        missing = set(wanted) - set(found)
        if missing:
            raise ValueError(
                f"--backends {','.join(wanted)}: {sorted(missing)} not available in this job "
                "(mpi needs mpirun/mpiexec; torch needs torchrun or mpirun)"
            )
    return found


@dataclass
class Case:
    """One operation at one size on one dtype, with its buffers allocated once."""

    op: str
    dtype: torch.dtype
    nbytes: int  # the message size as MixedBackend sees it (bytes of the input tensor)
    model_bytes: int  # bytes one rank sends under the cost model (for bus bandwidth)
    run: Callable[[Backend], Any]


def make_case(op: str, nbytes: int, dtype: torch.dtype, world_size: int) -> Case:
    """Buffers for ``op`` on a message of about ``nbytes`` bytes (rounded to whole elements, and
    for ``all_to_all`` to a multiple of the world size; for ``compressed_allreduce`` ``nbytes``
    is the size of the fp32 buffer being averaged).
    """
    n = world_size
    esize = torch.empty((), dtype=dtype).element_size()
    numel = max(1, nbytes // esize)
    if op == "all_to_all":
        numel = -(-numel // n) * n
    size = numel * esize
    if op == "all_reduce":
        t = torch.zeros(numel, dtype=dtype)
        return Case(op, dtype, size, model_bytes(op, size, n), lambda be: be.all_reduce(t))
    if op == "all_gather":
        t, out = torch.zeros(numel, dtype=dtype), torch.empty(numel * n, dtype=dtype)
        return Case(op, dtype, size, model_bytes(op, size, n), lambda be: be.all_gather(out, t))
    if op == "all_to_all":
        t, out = torch.zeros(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
        return Case(op, dtype, size, model_bytes(op, size, n), lambda be: be.all_to_all(out, t))
    if op == "broadcast":
        t = torch.zeros(numel, dtype=dtype)
        return Case(op, dtype, size, model_bytes(op, size, n), lambda be: be.broadcast(t, 0))
    if op == "compressed_allreduce":
        if dtype != torch.float32:
            raise ValueError(f"compressed_allreduce is measured on float32 buffers, not {dtype}")
        gen = torch.Generator().manual_seed(1234)
        x = torch.randn(numel, generator=gen)
        padded = padded_size(numel, n)
        we, se = torch.zeros(padded), torch.zeros(padded // n)
        out = torch.empty_like(x)
        return Case(
            op,
            dtype,
            size,
            compression_bytes(numel, n),
            lambda be: compressed_allreduce(x, we, se, be, out=out),
        )
    raise ValueError(f"unknown operation {op!r}; expected one of {COLLECTIVES}")


def time_case(be: Backend, case: Case, reps: int, warmup: int) -> float:
    """Median over ``reps`` of the slowest rank's time for one call of ``case`` on ``be``."""
    for _ in range(warmup):
        case.run(be)
    times = torch.zeros(reps, dtype=torch.float64)
    for r in range(reps):
        be.barrier()
        t0 = time.perf_counter()
        case.run(be)
        times[r] = time.perf_counter() - t0
    be.all_reduce(times, "max")
    return float(statistics.median(times.tolist()))


def busbw(case: Case, seconds: float) -> float:
    """Bytes one rank sends per second under the cost model (nccl-tests' "bus bandwidth")."""
    return case.model_bytes / seconds if seconds > 0 else float("nan")


def progress(total: int, rank: int, enabled: bool, desc: str) -> Any:
    """Progress on rank 0's stderr: a tqdm bar on a terminal; elsewhere (mpirun forwards output
    through pipes, and a bar redrawn with carriage returns never reaches the screen) one line
    every 10 seconds. A silent stand-in on other ranks or when disabled.
    """
    if not enabled or rank != 0:
        return _NoBar()
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm

            return tqdm(total=total, desc=desc, unit="pt", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            pass
    return _LineBar(total, desc)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass


class _LineBar(_NoBar):
    def __init__(self, total: int, desc: str, every: float = 10.0) -> None:
        self.total, self.desc, self.every = total, desc, every
        self.done, self.what = 0, ""
        self.start = self.last = time.perf_counter()

    def set_postfix_str(self, s: str) -> None:
        self.what = s

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.last >= self.every or self.done == self.total:
            self.last = now
            print(
                f"{self.desc}: {self.done}/{self.total} points, {now - self.start:.0f} s "
                f"({self.what})",
                file=sys.stderr,
                flush=True,
            )


def parse_list(text: str, allowed: Iterable[str], what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(
            f"{what}: {bad or text!r} not recognised; choose from {', '.join(allowed)}"
        )
    return items


def add_sweep_arguments(p: Any, default_factor: int) -> None:
    """The arguments ``tune`` and ``bench`` share: sizes, repetitions, operations, backends."""
    p.add_argument("--min-bytes", type=parse_bytes, default=1 << 10, help="smallest size (1KiB)")
    p.add_argument("--max-bytes", type=parse_bytes, default=64 << 20, help="largest size (64MiB)")
    p.add_argument(
        "--factor",
        type=count(2),
        default=default_factor,
        help=f"ratio of successive sizes ({default_factor})",
    )
    p.add_argument("--reps", type=count(1), default=5, help="timed repetitions per point (5)")
    p.add_argument("--warmup", type=count(0), default=2, help="untimed calls before timing (2)")
    p.add_argument(
        "--ops",
        type=lambda s: parse_list(s, COLLECTIVES, "--ops"),
        default=list(COLLECTIVES),
        help="comma-separated subset of " + ",".join(COLLECTIVES),
    )
    p.add_argument(
        "--backends",
        type=lambda s: parse_list(s, ("torch", "mpi"), "--backends"),
        default=None,
        help="restrict to these backends, comma-separated: torch, mpi (default: every "
        "available one)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
