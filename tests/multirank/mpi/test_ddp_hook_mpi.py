"""The DDP hook with an MPI-backed optimizer (DDP itself on gloo), on every rank of the job.

The optimizer's averages and 1-bit exchanges go through MpiBackend, which has no asynchronous
all-reduce: ``all_reduce_async`` runs them at once. Same checks as the gloo tests (1-bit Adam,
1-bit LAMB, 0/1 Adam): bit-identical to the standalone optimizer after every step, identical
replicas, no_sync sends nothing, nothing left to step() that the hook can start.
"""

from __future__ import annotations

import torch

from tests.multirank.test_ddp_hook_gloo import FREEZE, STEPS, _train


def test_hook_with_mpi_backend_equals_standalone(torch_backend, mpi_backend, allgather):
    del torch_backend  # DDP's process group (gloo); the optimizers use MPI
    onebit = _train(mpi_backend, 1e-4, 100, 2)  # several buckets, 2 passes per step
    lamb = _train(mpi_backend, 1e-4, None, 1, 0, False, "OnebitLamb")
    # 1-bit LAMB's compression stage through the hook: several buckets, 2 passes per step, an
    # inf on rank 1 at the first compression step (σ is frozen then)
    lamb_more = _train(mpi_backend, 1e-4, 100, 2, FREEZE + 1, False, "OnebitLamb")
    # 0/1 Adam: variance and 1-bit steps through the hook, several buckets, 2 passes per step
    zoa = _train(mpi_backend, 1e-4, 100, 2, 0, False, "ZeroOneAdam")
    everyone = allgather((onebit, lamb, lamb_more, zoa))
    for onebit, lamb, lamb_more, zoa in everyone:
        for r in (onebit, lamb, lamb_more, zoa):
            assert r["same_as_plain"] == [True] * STEPS, r["same_as_plain"]
            assert r["states_equal"]
            for replica in r["replicas"][1:]:
                assert torch.equal(r["replicas"][0], replica)
        for r in (onebit, lamb_more, zoa):
            assert r["calls_in_no_sync"] == [0] * STEPS
        for r in (onebit, lamb, lamb_more):
            assert r["compressed_in_step"] == [0] * STEPS
            assert r["full_in_step"] == [0] * STEPS
        sync = zoa["buckets"]  # only 0/1 Adam's sync steps (6, 8) exchange in step()
        assert zoa["compressed_in_step"] == [0, 0, 0, 0, 0, sync, 0, sync]
        assert zoa["full_in_step"] == [0] * STEPS
        assert lamb_more["untouched_at_bad"] is True
        assert lamb_more["skipped"] == lamb_more["skipped_ref"] == 1
