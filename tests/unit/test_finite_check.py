"""The optimizers' per-step finiteness check: a fast sum-first path with an exact fallback."""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commopt.optim._agreement import _all_finite


@settings(max_examples=200, deadline=None)
@given(
    hnp.arrays(
        np.float32,
        st.integers(0, 300),
        elements=st.floats(width=32, allow_nan=True, allow_infinity=True),
    )
)
def test_agrees_with_the_elementwise_check(values: np.ndarray) -> None:
    t = torch.from_numpy(values)
    assert _all_finite(t) == bool(torch.isfinite(t).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_one_bad_element_is_found(dtype: torch.dtype, bad: float) -> None:
    t = torch.randn(1000).to(dtype)
    t[517] = bad
    assert not _all_finite(t)


@pytest.mark.parametrize(("value", "dtype"), [(3e38, torch.float32), (60000.0, torch.float16)])
def test_finite_values_whose_sum_overflows_are_finite(value: float, dtype: torch.dtype) -> None:
    t = torch.full((10,), value, dtype=dtype)
    assert not bool(torch.isfinite(t.sum()))  # the fast path cannot decide here
    assert _all_finite(t)
