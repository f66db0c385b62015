"""The digest behind the "DDP without commopt's hook" warning: equal exactly when the gradient
bits are equal (up to collisions), for every dtype and for gradients that are views at any
offset (DDP's ``gradient_as_bucket_view``)."""

from __future__ import annotations

import pytest
import torch

from commopt.optim._agreement import gradient_digest


def _params(*grads: torch.Tensor) -> list[torch.nn.Parameter]:
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(g.shape, dtype=g.dtype))
        p.grad = g
        params.append(p)
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("numel", [1, 3, 8, 1001])
def test_equal_bits_equal_digest_and_one_ulp_differs(dtype: torch.dtype, numel: int) -> None:
    g = torch.randn(numel).to(dtype)
    assert gradient_digest(_params(g)) == gradient_digest(_params(g.clone()))
    moved = g.clone()
    moved[numel // 2] = torch.nextafter(moved[numel // 2], torch.tensor(1e4, dtype=dtype))
    assert gradient_digest(_params(g)) != gradient_digest(_params(moved))


def test_views_at_any_offset() -> None:
    bucket = torch.randn(64)
    for start in range(4):
        view = bucket[start : start + 21]
        assert gradient_digest(_params(view)) == gradient_digest(_params(view.clone()))


def test_order_and_missing_gradients() -> None:
    a, b = torch.randn(5), torch.randn(7)
    assert gradient_digest(_params(a, b)) != gradient_digest(_params(b, a))
    none = torch.nn.Parameter(torch.zeros(3))
    assert gradient_digest([none, *_params(a)]) == gradient_digest(_params(a))
    assert gradient_digest([none]) == 0
