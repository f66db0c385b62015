"""MpiBackend's non-blocking collectives (Iallreduce/Iallgather/Ialltoall + a progress thread).

Same bytes as the blocking calls, several in flight at once; the futures complete without the
caller polling MPI; and a thread blocked in an MPI call (blocking collective or ``Wait``) lets
the main thread run Python. Collectives first, assertions after (conftest.py).
"""

from __future__ import annotations

import time

import pytest
import torch
from mpi4py import MPI

from commopt.comm import MpiBackend, all_gather_async, all_reduce_async, all_to_all_async
from tests.multirank.gil_probe import poll_during


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.uint8])
def test_async_equals_blocking(mpi_backend: MpiBackend, world, allgather, dtype) -> None:
    rank, n = world
    gen = torch.Generator().manual_seed(31 * rank + 7)
    numel = 40 * n
    x = torch.randn(numel, generator=gen) * 100
    x = x.to(dtype) if dtype.is_floating_point else (x.to(torch.int64) % 60).to(dtype)
    ref_gather, ref_a2a = torch.empty(n * numel, dtype=dtype), torch.empty_like(x)
    mpi_backend.all_gather(ref_gather, x)
    mpi_backend.all_to_all(ref_a2a, x)
    ref_red = x.clone()
    mpi_backend.all_reduce(ref_red, "avg" if dtype.is_floating_point else "sum")
    gather, a2a, red = torch.empty(n * numel, dtype=dtype), torch.empty_like(x), x.clone()
    futs = [
        all_gather_async(mpi_backend, gather, x),
        all_to_all_async(mpi_backend, a2a, x),
        all_reduce_async(mpi_backend, red, "avg" if dtype.is_floating_point else "sum"),
    ]
    # Nobody calls MPI while waiting here: the progress thread must complete all three.
    deadline = time.monotonic() + 60
    while not all(f.done() for f in futs) and time.monotonic() < deadline:
        time.sleep(0.001)
    values = [f.wait() for f in reversed(futs)][::-1]
    everyone = allgather(_bits(gather))
    assert mpi_backend.nonblocking  # mpi4py asks for MPI_THREAD_MULTIPLE; Open MPI grants it
    assert values[0] is gather and values[1] is a2a and values[2] is red
    assert _bits(gather) == _bits(ref_gather) and _bits(a2a) == _bits(ref_a2a)
    assert _bits(red) == _bits(ref_red)
    assert len(set(everyone)) == 1


ATTEMPTS = 3


@pytest.mark.parametrize("how", ["blocking", "request"])
def test_waiting_in_mpi_releases_the_gil(mpi_backend: MpiBackend, world, allgather, how) -> None:
    """Rank 1 joins each collective a second late; every other rank's main thread must run
    Python in the middle half of its worker's wait, in at least one of ATTEMPTS tries (with the
    GIL held there it never could; the retries only absorb a main thread the OS did not schedule
    on a loaded machine)."""
    rank, _ = world
    t = torch.ones(1024)
    out = torch.empty_like(t)

    def communicate() -> None:
        if how == "blocking":
            MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, t.numpy(), op=MPI.SUM)
        else:
            all_to_all_async(mpi_backend, out, t).wait()

    tries: list[tuple[float, int]] = []
    for _ in range(ATTEMPTS):  # the same collectives on every rank, whatever the outcome
        MPI.COMM_WORLD.Barrier()  # rank 1's delay starts when every rank is ready
        if rank == 1:
            time.sleep(1.0)  # everyone else's collective waits for this rank
            communicate()
            continue
        tries.append(poll_during(communicate))
    results = allgather(tries)
    waiting = [r for i, r in enumerate(results) if i != 1]
    assert all(w > 0.5 for r in waiting for w, _ in r), results  # the workers did wait
    assert all(any(m > 0 for _, m in r) for r in waiting), results  # and main threads ran
