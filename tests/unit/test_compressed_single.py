"""compressed_allreduce in one process: the n = 1 contract, argument checks, padded_size."""

from __future__ import annotations

import pytest
import torch

from commopt import NonFiniteError, SingleProcessBackend, compressed_allreduce, padded_size
from commopt.compressed import compression_bytes


def buffers(numel: int, n: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    padded = padded_size(numel, n)
    return torch.zeros(padded), torch.zeros(padded // n)


# -- padded_size --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "numel,n,expected",
    [(0, 1, 0), (1, 1, 8), (8, 1, 8), (9, 1, 16), (1, 4, 32), (32, 4, 32), (33, 4, 64), (7, 3, 24)],
)
def test_padded_size_values(numel, n, expected):
    assert padded_size(numel, n) == expected


@pytest.mark.parametrize("numel", [1, 7, 1001, 4099, 10**6 + 3])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8])
def test_padded_size_is_smallest_multiple_of_8n(numel, n):
    padded = padded_size(numel, n)
    assert padded % (8 * n) == 0
    assert numel <= padded < numel + 8 * n


@pytest.mark.parametrize("numel,n", [(-1, 1), (5, 0), (5, -2)])
def test_padded_size_rejects_bad_arguments(numel, n):
    with pytest.raises(ValueError, match="padded_size needs numel >= 0 and world_size >= 1"):
        padded_size(numel, n)


# -- n = 1 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (2, 3, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_single_rank_returns_buffer_unchanged_and_sends_nothing(shape, dtype):
    be = SingleProcessBackend()
    x = torch.randn(shape).to(dtype)
    x_before = x.clone()
    e, f = buffers(x.numel())
    e.fill_(0.25)  # the errors are not used (nor changed) by a world of one
    f.fill_(-0.5)
    y = compressed_allreduce(x, e, f, be)
    assert y is not x, "without out= a new tensor is returned"
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, x_before) and torch.equal(x, x_before)
    assert torch.equal(e, torch.full_like(e, 0.25)) and torch.equal(f, torch.full_like(f, -0.5))
    assert be.stats.calls == 0 and be.stats.bytes_sent == 0
    assert compression_bytes(x.numel(), 1) == 0


def test_single_rank_out_argument():
    be = SingleProcessBackend()
    x = torch.randn(5, 3)
    e, f = buffers(15)
    out = torch.empty(5, 3)
    assert compressed_allreduce(x, e, f, be, out=out) is out
    assert torch.equal(out, x)
    assert compressed_allreduce(x, e, f, be, out=x) is x  # in place is allowed
    with pytest.raises(ValueError, match="out must match"):
        compressed_allreduce(x, e, f, be, out=torch.empty(15))
    with pytest.raises(ValueError, match="out must match"):
        compressed_allreduce(x, e, f, be, out=torch.empty(5, 3, dtype=torch.float64))


def test_single_rank_default_backend_is_a_world_of_one():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a torch.distributed group is initialized in this process")
    x = torch.arange(10.0)
    e, f = buffers(10)
    assert torch.equal(compressed_allreduce(x, e, f), x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_single_rank_non_finite_raises_and_leaves_errors(bad):
    x = torch.randn(9)
    x[4] = bad
    e, f = buffers(9)
    e.normal_()
    f.normal_()
    e0, f0 = e.clone(), f.clone()
    with pytest.raises(NonFiniteError, match=r"rank\(s\) \[0\]") as info:
        compressed_allreduce(x, e, f, SingleProcessBackend())
    assert info.value.ranks == [0]
    assert isinstance(info.value, FloatingPointError)
    assert torch.equal(e, e0) and torch.equal(f, f0)


def test_empty_buffer():
    x = torch.empty(0)
    e, f = buffers(0)
    assert compressed_allreduce(x, e, f, SingleProcessBackend()).numel() == 0


# -- argument checks ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_non_float_tensor_is_a_type_error(dtype):
    e, f = buffers(4)
    with pytest.raises(TypeError, match="needs a floating-point tensor"):
        compressed_allreduce(torch.zeros(4, dtype=dtype), e, f, SingleProcessBackend())


def test_non_tensor_is_a_type_error():
    e, f = buffers(4)
    with pytest.raises(TypeError, match="needs a floating-point tensor"):
        compressed_allreduce([1.0, 2.0, 3.0, 4.0], e, f, SingleProcessBackend())


def test_wrong_size_error_buffers():
    x = torch.randn(10)
    e, f = buffers(10)
    be = SingleProcessBackend()
    with pytest.raises(
        ValueError, match=r"worker_error has 10 elements; expected padded_size\(10, 1\) = 16"
    ):
        compressed_allreduce(x, torch.zeros(10), f, be)
    with pytest.raises(ValueError, match=r"server_error has 17 elements; expected .* // 1 = 16"):
        compressed_allreduce(x, e, torch.zeros(17), be)


def test_wrong_dtype_error_buffers():
    x = torch.randn(10)
    e, f = buffers(10)
    be = SingleProcessBackend()
    with pytest.raises(TypeError, match=r"worker_error must be float32, got torch\.float64"):
        compressed_allreduce(x, e.double(), f, be)
    with pytest.raises(TypeError, match=r"server_error must be float32, got torch\.float16"):
        compressed_allreduce(x, e, f.half(), be)
    with pytest.raises(TypeError, match=r"worker_error must be a torch\.Tensor"):
        compressed_allreduce(x, e.numpy(), f, be)


def test_wrong_device_error_buffers():
    # The meta device stands in for "another device" without needing a GPU.
    x = torch.randn(10)
    e, f = buffers(10)
    be = SingleProcessBackend()
    with pytest.raises(ValueError, match="worker_error is on meta but the tensor is on cpu"):
        compressed_allreduce(x, torch.zeros(16, device="meta"), f, be)
    with pytest.raises(ValueError, match="server_error is on meta but the tensor is on cpu"):
        compressed_allreduce(x, e, torch.zeros(16, device="meta"), be)


def test_non_contiguous_error_buffer():
    x = torch.randn(10)
    _, f = buffers(10)
    with pytest.raises(ValueError, match="worker_error must be contiguous"):
        compressed_allreduce(x, torch.zeros(32)[::2], f, SingleProcessBackend())
