"""The pipelined compressed allreduce inside the mpiexec job: MpiBackend's non-blocking
collectives (Ialltoall/Iallgather through the progress thread) and gloo bootstrapped over MPI.

Each rank runs the same stateful calls unpipelined and staged, on both backends: outputs, e and
f must have the same bits in all four runs, and the outputs the same bits on every rank. Errors
are raised on every rank with the buffers untouched. Collectives first, assertions after.
"""

from __future__ import annotations

import pytest
import torch

from commopt import NonFiniteError, compressed_allreduce, padded_size
from commopt.pipelined import ALIGN

CALLS = 3


def _x(rank: int, call: int, length: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * call + 100 * rank + length)
    return torch.randn(length, generator=g) * (1 + rank) + 0.1 * call


def _run(backend, rank: int, length: int, stages: int) -> list[bytes]:
    n = backend.world_size
    e, f = torch.zeros(padded_size(length, n)), torch.zeros(padded_size(length, n) // n)
    out = []
    for call in range(CALLS):
        y = compressed_allreduce(_x(rank, call, length), e, f, backend, pipeline=stages)
        out += [y.numpy().tobytes(), e.numpy().tobytes(), f.numpy().tobytes()]
    return out


@pytest.mark.parametrize("extra", [5, -3, 8 * 4 * 3 * ALIGN + 1])
def test_pipelined_equals_unpipelined_over_mpi_and_gloo(
    mpi_backend, torch_backend, world, allgather, extra: int
) -> None:
    rank, n = world
    length = 3 * ALIGN * n + extra
    runs = {
        (name, stages): _run(be, rank, length, stages)
        for name, be in (("mpi", mpi_backend), ("gloo", torch_backend))
        for stages in (1, 3)
    }
    outputs = allgather(runs[("mpi", 3)][0::3])
    assert mpi_backend.nonblocking
    ref = runs[("mpi", 1)]
    for key, got in runs.items():
        assert got == ref, f"rank {rank}: {key} differs from unpipelined MPI (L={length})"
    assert all(o == outputs[0] for o in outputs)


def test_pipelined_errors_on_every_rank(mpi_backend, world, allgather) -> None:
    rank, n = world
    length = 3 * ALIGN * n + 5
    padded = padded_size(length, n)
    e = torch.full((padded,), 0.25 * (rank + 1))
    f = torch.full((padded // n,), -0.5)
    e0, f0 = e.clone(), f.clone()
    x = _x(rank, 0, length)
    if rank == 2 % n:
        x[-1] = float("inf")
    got = {}
    try:
        compressed_allreduce(x, e, f, mpi_backend, pipeline=3)
    except NonFiniteError as err:
        got["nonfinite"] = err.ranks
    mine = length + (8 * n if rank == 1 else 0)
    e2, f2 = torch.zeros(padded_size(mine, n)), torch.zeros(padded_size(mine, n) // n)
    try:
        compressed_allreduce(_x(rank, 1, mine), e2, f2, mpi_backend, pipeline=3)
    except ValueError as err:
        got["length"] = str(err)
    got["untouched"] = bool(torch.equal(e, e0) and torch.equal(f, f0))
    got["untouched2"] = not (bool(e2.any()) or bool(f2.any()))
    everyone = allgather(got)
    for g in everyone:
        assert g["nonfinite"] == [2 % n]
        assert "every rank must pass the same number of elements" in g["length"]
        assert g["untouched"] and g["untouched2"]
