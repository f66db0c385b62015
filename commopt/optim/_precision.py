"""Mixed precision: fp32 master weights for bf16/fp16 parameters, and GradScaler's unscale.

The algorithms always run in fp32. For a bf16/fp16 parameter the fp32 value it is computed
from is a flat ``"master"`` buffer of its bucket (saved in ``state_dict()`` like any state, so a
resumed run continues from the unrounded weights); the parameter itself is its rounding.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, MutableMapping
from typing import Any

import torch

from commopt.buckets import Bucket, Segment
from commopt.optim.flat_state import FlatState

__all__ = ["master_weights", "unscale_grads_"]


@contextlib.contextmanager
def master_weights(
    states: Iterable[FlatState], param_state: MutableMapping[torch.Tensor, dict[str, Any]]
) -> Iterator[None]:
    """Inside: in every bucket, each non-fp32 parameter is replaced by its fp32 master copy (a
    view of the bucket's ``"master"`` buffer, its ``.grad`` the gradient widened to fp32,
    exactly); on exit the parameter is rounded from it. The master copy starts as the
    parameter's value.

    The parameter itself is never touched inside: swapping its ``.data`` to another dtype would
    drop the gradient-accumulator hooks DDP registered on it (and DDP would wait at the next
    step for gradients that never come)."""
    swapped: list[tuple[Bucket, list[torch.Tensor], list[Segment]]] = []
    rounding: list[tuple[torch.Tensor, torch.Tensor]] = []
    for state in states:
        bucket = state.bucket
        if all(p.dtype == torch.float32 for p in bucket.params):
            continue
        fresh = {id(p) for p in bucket.params if "master" not in param_state[p]}
        master = state.buffer("master")
        proxies: dict[int, torch.Tensor] = {}
        for p, view in zip(bucket.params, bucket.views(master), strict=True):
            if p.dtype == torch.float32:
                param_state[p].pop("master", None)  # fp32 parameters are their own master
                continue
            if id(p) in fresh:
                view.copy_(p)
            if p.grad is not None:
                view.grad = p.grad.to(torch.float32)
            proxies[id(p)] = view
            rounding.append((p, view))
        swapped.append((bucket, bucket.params, bucket.segments))
        bucket.params = [proxies.get(id(p), p) for p in bucket.params]
        bucket.segments = [
            dataclasses.replace(seg, params=tuple(proxies.get(id(p), p) for p in seg.params))
            for seg in bucket.segments
        ]
    try:
        yield
    finally:
        for bucket, params, segments in swapped:
            bucket.params, bucket.segments = params, segments
        with torch.no_grad():
            for p, view in rounding:
                p.copy_(view)
                view.grad = None


def unscale_grads_(params: Iterable[torch.Tensor], scale: torch.Tensor | float) -> None:
    """g ← g / scale in place, as ``GradScaler.unscale_`` (the reciprocal in double, then fp32)."""
    inv = scale.double().reciprocal().float() if torch.is_tensor(scale) else 1.0 / scale
    for p in params:
        if p.grad is not None:
            p.grad.mul_(inv.to(p.grad.device) if torch.is_tensor(inv) else inv)
