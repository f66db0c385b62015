"""What a call of ``compressed_allreduce`` without ``out=`` costs against one with it (CPU).

    python -m experiments.allreduce.out_none

2 forked gloo ranks on loopback, 16M fp32 elements, the two calls interleaved, median of 6
after one untimed round, printed per rank in ms. Without ``out=`` the result's buffer comes
from :mod:`commopt.output_pool` once the previous result has been dropped.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import commopt
from commopt.compressed import padded_size
from experiments.harness import run_ranks


def measure(backend, reps: int) -> dict[str, float]:
    torch.set_num_threads(1)
    n, numel = backend.world_size, 1 << 24
    x = torch.randn(numel, generator=torch.Generator().manual_seed(backend.rank))
    e, f = torch.zeros(padded_size(numel, n)), torch.zeros(padded_size(numel, n) // n)
    out = torch.empty_like(x)
    times: dict[str, list[float]] = {"with out=": [], "without out=": []}
    for _ in range(reps):
        for kind in times:
            t = time.perf_counter()
            y = commopt.compressed_allreduce(x, e, f, backend, out=out if "with " in kind else None)
            times[kind].append(time.perf_counter() - t)
            del y
    return {kind: round(1e3 * statistics.median(v[1:]), 1) for kind, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--ranks", type=int, default=2, help="forked gloo ranks (default 2)")
    parser.add_argument("--reps", type=int, default=7, help="rounds, the first untimed (7)")
    args = parser.parse_args(argv)
    for rank, row in enumerate(run_ranks(measure, args.ranks, args.reps, timeout=300)):
        print(f"rank {rank}: {row}")


if __name__ == "__main__":
    main()
