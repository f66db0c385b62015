"""overlap=True on MpiBackend: the communication thread issues the MPI calls.

MPI is initialised by mpi4py at MPI_THREAD_MULTIPLE; the thread and ``step()`` never call MPI at
the same time (``step()`` drains the thread first), so MPI_THREAD_SERIALIZED would be enough.
Same checks as the gloo tests, for 1-bit Adam, 1-bit LAMB and 0/1 Adam: bit-identical to
overlap=False after every step in every phase, identical replicas, a second synced backward
pass, no_sync sends nothing, a non-finite gradient on one rank skips the step everywhere with
nothing touched, and a resume from ``state_dict`` with overlap on; 0/1 Adam's syncs staged during
backward (a non-finite gradient at one, lr changed before ``step()`` at another).
"""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

from tests.multirank.test_overlap_gloo import (
    NAMES,
    STEPS,
    _compressed_in_step,
    _resume,
    _train,
)
from tests.optim_registry import OPTIMIZERS

#: the first step exchanged at one bit during backward, with rank 1's gradient inf (1-bit
#: LAMB: where σ is frozen; 0/1 Adam: a phase-A 1-bit step)
BAD_STEP = {
    info.name: next(
        ph.first
        for ph in info.phases(STEPS, backward=True)
        if ph.communicates and not ph.updates_variance
    )
    for info in OPTIMIZERS
}


@pytest.mark.parametrize("name", NAMES)
def test_overlap_with_mpi_backend_equals_no_overlap(mpi_backend, allgather, name):
    assert MPI.Query_thread() >= MPI.THREAD_SERIALIZED
    several = _train(mpi_backend, 100, 1, 0, False, True, name)
    second_pass = _train(mpi_backend, 100, 2, 0, True, False, name)
    accumulate = _train(mpi_backend, 100, 3, 0, False, False, name)
    bad = _train(mpi_backend, 100, 1, BAD_STEP[name], False, False, name)
    resumed, _ = _resume(mpi_backend, name, 4)
    everyone = allgather((several, second_pass, accumulate, bad, resumed))
    for several, second_pass, accumulate, bad, resumed in everyone:
        for r in (several, second_pass, accumulate, bad):
            assert r["same"] == [True] * STEPS, r["same"]
            assert r["states_equal"]
        # 0/1 Adam's skipped step shifts its schedule: that run ends on a local step
        for r in (several, second_pass, accumulate, *([bad] if name != "ZeroOneAdam" else [])):
            for replica in r["replicas"][1:]:
                assert torch.equal(r["replicas"][0], replica)
        assert any(who.startswith("commopt-") for who, _, _ in several["log"])
        assert several["full_in_step"] == [0] * STEPS
        assert several["compressed_in_step"] == _compressed_in_step(name, len(several["buckets"]))
        assert accumulate["calls_in_no_sync"] == [0] * (2 * STEPS)
        assert bad["untouched"] is True
        assert bad["skipped"] == [1, 1]
        assert resumed == [True] * STEPS, resumed
    logs = [e[0]["log"] for e in everyone]
    assert all(log == logs[0] for log in logs)  # the same collectives in the same order


def test_overlap_zero_one_sync_with_mpi_backend(mpi_backend, allgather):
    # 0/1 Adam's syncs, staged during backward: a non-finite gradient at one (skipped, nothing
    # touched), lr changed between backward and step() at another (synced again in step()).
    name = "ZeroOneAdam"
    mine = (
        _train(mpi_backend, 100, 1, 8, False, False, name),
        _train(mpi_backend, 100, 1, 0, False, False, name, {"change_at": (6, "lr", 0.01)}),
    )
    for bad, changed in allgather(mine):
        for r in (bad, changed):
            assert r["same"] == [True] * STEPS, r["same"]
            assert r["states_equal"]
        assert bad["untouched"] is True
        assert bad["skipped"] == [1, 1]
        assert bad["compressed_in_step"] == [0] * STEPS
        for replica in changed["replicas"][1:]:
            assert torch.equal(changed["replicas"][0], replica)
        buckets = len(changed["buckets"])
        assert changed["compressed_in_step"] == [0] * 5 + [buckets] + [0] * (STEPS - 6)
