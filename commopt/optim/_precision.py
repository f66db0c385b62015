"""Mixed precision: fp32 master weights for bf16/fp16 parameters, and GradScaler's unscale.

The algorithms always run in fp32. For a bf16/fp16 parameter the fp32 value it is computed
from is a flat ``"master"`` buffer of its bucket (saved in ``state_dict()`` like any state, so a
resumed run continues from the unrounded weights); the parameter itself is its rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, MutableMapping
from typing import Any

import torch

from commopt.optim.flat_state import FlatState

__all__ = ["master_weights", "unscale_grads_"]


@contextlib.contextmanager
def master_weights(
    states: Iterable[FlatState], param_state: MutableMapping[torch.Tensor, dict[str, Any]]
) -> Iterator[None]:
    """Inside: every non-fp32 parameter's ``.data`` is its fp32 master copy; on exit the
    parameter is rounded from it. The master copy starts as the parameter's value."""
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
    for state in states:
        bucket = state.bucket
        if all(p.dtype == torch.float32 for p in bucket.params):
            continue
        fresh = {id(p) for p in bucket.params if "master" not in param_state[p]}
        master = state.buffer("master")
        for p, view in zip(bucket.params, bucket.views(master), strict=True):
            if p.dtype == torch.float32:
                param_state[p].pop("master", None)  # fp32 parameters are their own master
                continue
            if id(p) in fresh:
                view.copy_(p)
            swapped.append((p, p.data))
            p.data = view
    try:
        yield
    finally:
        for p, low in swapped:
            low.copy_(p.data)
            p.data = low


def unscale_grads_(params: Iterable[torch.Tensor], scale: torch.Tensor | float) -> None:
    """g ← g / scale in place, as ``GradScaler.unscale_`` (the reciprocal in double, then fp32)."""
    inv = scale.double().reciprocal().float() if torch.is_tensor(scale) else 1.0 / scale
    for p in params:
        if p.grad is not None:
            p.grad.mul_(inv.to(p.grad.device) if torch.is_tensor(inv) else inv)
