"""OnebitAdam(overlap=True) on MpiBackend: the communication thread issues the MPI calls.

MPI is initialised by mpi4py at MPI_THREAD_MULTIPLE; the thread and ``step()`` never call MPI at
the same time (``step()`` drains the thread first), so MPI_THREAD_SERIALIZED would be enough.
Same checks as the gloo tests: bit-identical to overlap=False after every step, in the warmup
and the compression stage, identical replicas, a second synced backward pass, no_sync sends
nothing, and a non-finite gradient on one rank skips the step everywhere with nothing touched.
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from tests.multirank.test_overlap_gloo import STEPS, _train


def test_overlap_with_mpi_backend_equals_no_overlap(mpi_backend, allgather):
    assert MPI.Query_thread() >= MPI.THREAD_SERIALIZED
    several = _train(mpi_backend, 100, 1, 0, False, True)
    second_pass = _train(mpi_backend, 100, 2, 0, True)
    accumulate = _train(mpi_backend, 100, 3, 0)
    bad = _train(mpi_backend, 100, 1, 6)  # compression stage, rank 1's gradient is inf
    everyone = allgather((several, second_pass, accumulate, bad))
    for several, second_pass, accumulate, bad in everyone:
        for r in (several, second_pass, accumulate, bad):
            assert r["same"] == [True] * STEPS, r["same"]
            assert r["states_equal"]
            for replica in r["replicas"][1:]:
                assert torch.equal(r["replicas"][0], replica)
        assert any(who.startswith("commopt-") for who, _, _ in several["log"])
        assert several["compressed_in_step"] == [0] * STEPS
        assert accumulate["calls_in_no_sync"] == [0] * (2 * STEPS)
        assert bad["untouched"] is True
        assert bad["skipped"] == [1, 1]
    logs = [e[0]["log"] for e in everyone]
    assert all(log == logs[0] for log in logs)  # the same collectives in the same order
