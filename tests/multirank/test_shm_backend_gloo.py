"""SharedMemoryBackend on forked gloo ranks: the same bytes as gloo, and as a hierarchical level."""

from __future__ import annotations

import pytest
import torch

from commopt.comm.shm_backend import SharedMemoryBackend
from commopt.exchange import HierarchicalExchange
from commopt.exchange.levels import build_level_backends
from commopt.exchange.topology import discover_topology
from tests.multirank.harness import RankError, run_ranks

TIMEOUT = 120.0


def _collectives(backend):
    shm = SharedMemoryBackend(backend)
    g = torch.Generator().manual_seed(backend.rank)
    n = backend.world_size
    results = {}
    for name, be in (("gloo", backend), ("shm", shm)):
        x = torch.randn(6, 5, generator=torch.Generator().manual_seed(backend.rank))
        gathered = torch.empty(n * 30)
        be.all_gather(gathered, x)
        swapped = torch.empty(n * 4, 3)
        be.all_to_all(
            swapped, torch.arange(n * 12, dtype=torch.float32).view(n * 4, 3) + 100 * backend.rank
        )
        summed = x.clone()
        be.all_reduce(summed)
        biggest = x.clone()
        be.all_reduce(biggest, "max")
        sent = x.clone()
        be.broadcast(sent, n - 1)
        results[name] = [gathered, swapped, summed, biggest, sent]
    big = torch.randn(3 * n * 1000, generator=g)  # grows the segment
    out = torch.empty(n * big.numel())
    shm.all_gather(out, big)
    return results, out.view(n, -1)[backend.rank].equal(big), shm.stats.calls_by_op


def test_same_results_as_gloo() -> None:
    for results, own_row, calls in run_ranks(_collectives, 4, timeout=TIMEOUT):
        gathered, summed = results["shm"][0], results["shm"][2]
        for i in (0, 1, 3, 4):  # data movement and max: the very same bytes as gloo
            assert torch.equal(results["gloo"][i], results["shm"][i])
        # The sum runs in rank order (gloo's ring does not): exact against that order.
        rows = gathered.view(4, 6, 5)
        assert torch.equal(summed, ((rows[0] + rows[1]) + rows[2]) + rows[3])
        torch.testing.assert_close(summed, results["gloo"][2])
        assert own_row
        assert calls == {"all_gather": 2, "all_to_all": 1, "all_reduce": 2, "broadcast": 1}


def _hierarchical_levels(backend):
    env = {
        "LOCAL_RANK": str(backend.rank % 2),
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": str(backend.rank // 2),
    }
    topo = discover_topology(backend, env)
    local, cross = build_level_backends(backend, topo)
    outs = []
    built = HierarchicalExchange(backend, topo, shared_memory=True)
    assert isinstance(built.local_backend, SharedMemoryBackend)
    for ex in (
        HierarchicalExchange(backend, topo, local_backend=local, cross_backend=cross),
        HierarchicalExchange(
            backend, topo, local_backend=SharedMemoryBackend(local), cross_backend=cross
        ),
        built,
    ):
        state = {k: torch.zeros(v) for k, v in ex.state_numels(10_001).items()}
        ys = []
        for call in range(3):
            y = torch.randn(
                10_001, generator=torch.Generator().manual_seed(10 * backend.rank + call)
            )
            ex.allreduce_(y, state)
            ys.append(y)
        outs.append([*ys, state["worker_error"], state["server_error"]])
    return outs


def test_hierarchical_local_level_over_shared_memory_is_bit_identical() -> None:
    per_rank = run_ranks(_hierarchical_levels, 4, timeout=TIMEOUT)
    for over_gloo, over_shm, built in per_rank:
        for a, b, c in zip(over_gloo, over_shm, built, strict=True):
            assert torch.equal(a, b) and torch.equal(a, c)
    for _, over_shm, _ in per_rank:
        assert torch.equal(over_shm[2], per_rank[0][1][2])


def _non_contiguous(backend):
    shm = SharedMemoryBackend(backend)
    t = torch.zeros(4, 4).t()
    shm.all_gather(torch.empty(backend.world_size * 16), t)


def test_non_contiguous_is_refused() -> None:
    with pytest.raises(RankError) as info:
        run_ranks(_non_contiguous, 2, timeout=TIMEOUT)
    assert all(m and "contiguous" in m for m in info.value.messages)


def _too_small(backend, fallback: bool):
    """/dev/shm reports 1 KiB free: with fallback the messages go through the helper (same
    results, one warning); without, every rank raises."""
    import os
    import warnings

    from commopt.comm import shm_backend

    real = os.statvfs

    class Tiny:
        def __init__(self, st):
            self.f_frsize, self.f_bavail = 1, 1024

    shm_backend.os.statvfs = lambda path: Tiny(real(path))
    try:
        shm = SharedMemoryBackend(backend, fallback=fallback)
        n, rank = backend.world_size, backend.rank
        x = torch.arange(4 * 1001, dtype=torch.float32) * (rank + 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out = torch.empty(1001)
                shm.reduce_scatter_mean_(out, x[:4003])  # 4003 of 4004: one padded element
                gathered = torch.empty(n * 3)
                shm.all_gather(gathered, torch.full((3,), float(rank)))
            except RuntimeError as err:
                return str(err)
        expect = torch.zeros(4 * 1001)
        expect[:4003] = torch.arange(4003, dtype=torch.float32)
        expect = expect.view(n, 1001)[rank] * sum(range(1, n + 1)) / n
        return (
            torch.equal(out, expect),
            torch.equal(gathered, torch.arange(n).repeat_interleave(3).float()),
            [str(w.message) for w in caught],
        )
    finally:
        shm_backend.os.statvfs = real


def test_a_too_small_dev_shm_falls_back_to_the_helper_or_raises() -> None:
    for same_sum, same_gather, warned in run_ranks(_too_small, 4, True, timeout=TIMEOUT):
        assert same_sum and same_gather
        assert len(warned) == 1 and "go through the node's TorchBackend" in warned[0]
    for message in run_ranks(_too_small, 4, False, timeout=TIMEOUT):
        assert "has less than the" in message and "bytes free" in message
