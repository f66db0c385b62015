"""The backend contract's bookkeeping: the cost model, CommStats, SingleProcessBackend."""

from __future__ import annotations

import pytest
import torch

from commopt.comm import OPERATIONS, Backend, CommStats, SingleProcessBackend, model_bytes
from commopt.comm.base import check_equal_split
from commopt.compressed import compression_bytes, padded_size


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_model_bytes_table(n):
    b = 4096
    assert model_bytes("all_reduce", b, n) == 2 * (n - 1) * b // n
    assert model_bytes("all_gather", b, n) == (n - 1) * b
    assert model_bytes("all_to_all", b, n) == (n - 1) * b // n
    assert model_bytes("broadcast", b, n) == (n - 1) * b // n
    assert model_bytes("barrier", b, n) == 0


def test_model_bytes_world_of_one_and_unknown_op():
    assert all(model_bytes(op, 1000, 1) == 0 for op in OPERATIONS)
    with pytest.raises(ValueError, match="unknown operation 'scatter'"):
        model_bytes("scatter", 10, 2)


@pytest.mark.parametrize("numel", [1, 7, 1001, 4099, 1 << 20])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_compression_bytes_is_the_sum_of_its_four_collectives(numel, n):
    """SPEC §7: 2·(n−1)/n·N/8 for the bits plus O(n) for the scales (and the length check)."""
    padded = padded_size(numel, n)
    chunk_bytes = padded // (8 * n)
    collectives = (
        model_bytes("all_gather", 4 * 4, n)  # phase 1a: (s, L, safe?) as four fp32
        + model_bytes("all_to_all", padded // 8, n)  # phase 1b: sign chunks
        + model_bytes("all_gather", chunk_bytes, n)  # phase 2: server signs
        + model_bytes("all_gather", 4, n)  # phase 2: server scales
    )
    assert compression_bytes(numel, n) == collectives
    bits = 2 * (n - 1) * padded // (8 * n)
    assert bits <= compression_bytes(numel, n) <= bits + 20 * n
    # 32× less than an fp32 ring all-reduce of the padded buffer, up to the scale bytes.
    assert model_bytes("all_reduce", 4 * padded, n) == 32 * bits


def test_comm_stats_record_snapshot_difference_reset():
    stats = CommStats()
    stats.record("all_reduce", 400, 4)
    stats.record("all_gather", 8, 4)
    before = stats.snapshot()
    stats.record("all_gather", 8, 4)
    stats.record("barrier", 0, 4)
    assert stats.calls == 4
    assert stats.bytes_sent == 600 + 24 + 24
    assert stats.calls_by_op == {"all_reduce": 1, "all_gather": 2, "barrier": 1}
    assert stats.bytes_by_op == {"all_reduce": 600, "all_gather": 48, "barrier": 0}
    assert before.calls == 2 and before.calls_by_op == {"all_reduce": 1, "all_gather": 1}
    delta = stats - before
    assert delta.calls == 2 and delta.bytes_sent == 24
    assert delta.calls_by_op == {"all_reduce": 0, "all_gather": 1, "barrier": 1}
    stats.reset()
    assert (stats.calls, stats.bytes_sent, stats.calls_by_op, stats.bytes_by_op) == (0, 0, {}, {})
    assert before.calls == 2, "a snapshot is independent of later changes"


def test_single_process_backend_is_identity():
    be = SingleProcessBackend()
    assert isinstance(be, Backend)
    assert (be.rank, be.world_size) == (0, 1)
    t = torch.arange(6.0)
    assert be.all_reduce(t, "sum") is t and torch.equal(t, torch.arange(6.0))
    assert be.broadcast(t, 0) is t
    out = torch.empty(6)
    assert be.all_gather(out, t) is out and torch.equal(out, t)
    out2 = torch.empty(6)
    assert be.all_to_all(out2, t) is out2 and torch.equal(out2, t)
    be.barrier()
    assert be.stats.calls == 0 and be.stats.bytes_sent == 0
    with pytest.raises(ValueError, match="src 1 out of range for a world of 1"):
        be.broadcast(t, 1)
    with pytest.raises(ValueError, match="expecting an output of 1 x 6 elements, got 5"):
        be.all_gather(torch.empty(5), t)


def test_check_equal_split():
    check_equal_split("all_gather", torch.empty(12), torch.empty(3), 4)
    check_equal_split("all_to_all", torch.empty(4, 2), torch.empty(4, 2), 4)
    with pytest.raises(ValueError, match="expecting an output of 4 x 3 elements, got 11"):
        check_equal_split("all_gather", torch.empty(11), torch.empty(3), 4)
    with pytest.raises(ValueError, match=r"output dtype torch\.float64 differs"):
        check_equal_split("all_gather", torch.empty(12, dtype=torch.float64), torch.empty(3), 4)
    with pytest.raises(ValueError, match="do not split equally over 4 ranks"):
        check_equal_split("all_to_all", torch.empty(6), torch.empty(6), 4)
    with pytest.raises(ValueError, match="output has 8 elements, input 6"):
        check_equal_split("all_to_all", torch.empty(8), torch.empty(6), 2)
    with pytest.raises(ValueError, match="must be contiguous"):
        check_equal_split("all_to_all", torch.empty(4, 4).t(), torch.empty(4, 4), 2)
