r"""The Adam arithmetic the three optimizers share, as free functions on tensors.

No optimizer, bucket or backend in sight: each function is one line of the papers, applied
to flat slices or lists of views, in place, with torch.optim.Adam's exact operations (``lerp``
for the momentum, one ``addcdiv`` for the update) so that results match it bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from commopt.step_guard import guarded_denominator, guarded_elements

if TYPE_CHECKING:
    from commopt.buckets import Segment
    from commopt.optim.flat_state import FlatState

__all__ = [
    "adam_update_",
    "denominator_",
    "guarded_adam_update_",
    "momentum_from_grads_",
    "update_moments_",
]


def update_moments_(
    m: torch.Tensor, v: torch.Tensor | None, g: torch.Tensor, beta1: float, beta2: float
) -> None:
    r"""m ← β1·m + (1−β1)·g (as ``lerp``);  v ← β2·v + (1−β2)·g² (skipped when v is None)."""
    m.lerp_(g, 1 - beta1)
    if v is not None:
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)


def momentum_from_grads_(
    m_views: Sequence[torch.Tensor], params: Sequence[torch.Tensor], beta1: float
) -> None:
    r"""m ← β1·m + (1−β1)·g with each parameter's own gradient, read where it is.

    A parameter without a gradient contributes g = 0 (m ← β1·m). bf16/fp16 gradients are
    widened to the state's fp32 (exactly) because ``lerp`` wants one dtype.
    """
    views, grads, without = [], [], []
    for view, p in zip(m_views, params, strict=True):
        if p.grad is None:
            without.append(view)
        else:
            views.append(view)
            grads.append(p.grad.to(view.dtype))
    if views:
        torch._foreach_lerp_(views, grads, 1 - beta1)
    if without:
        torch._foreach_mul_(without, beta1)


def denominator_(out: torch.Tensor, v: torch.Tensor, bias_sqrt: float, eps: float) -> None:
    r"""out = √v / b + ε, with b = √(1−β2ᵗ) (1 without bias correction)."""
    torch.sqrt(v, out=out)
    if bias_sqrt != 1.0:  # x / 1 == x exactly: skipping it changes no bit
        out.div_(bias_sqrt)
    out.add_(eps)


def adam_update_(
    params: Sequence[torch.Tensor],
    m_views: Sequence[torch.Tensor],
    d_views: Sequence[torch.Tensor],
    lr: float,
    weight_decay: float,
    step_size: float,
) -> None:
    r"""p ← p·(1 − η·λ) − step_size·m/d: decoupled decay, then one ``addcdiv`` (torch's Adam).

    step_size is η/(1−β1ᵗ) with bias correction, η without.
    """
    params = list(params)
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_addcdiv_(params, list(m_views), list(d_views), value=-step_size)


def guarded_adam_update_(
    state: FlatState,
    segments: Iterable[tuple[Segment, dict[str, Any]]],
    m: torch.Tensor,
    d: torch.Tensor,
    step_sizes: Sequence[float],
    limits: Sequence[float | None],
    step_guard: bool | str,
    target: torch.Tensor | None = None,
) -> None:
    r"""p ← p·(1 − η·λ) − step_size·m/d′ for each segment and its group, where d′ = d except
    on the elements the step guard names (:func:`~commopt.step_guard.guarded_elements`):
    d′ = max(d, |m|/limit) there, so |m/d′| ≤ limit. ``limits[k]`` None: segment k is not
    guarded (d′ = d). ``target``: a flat buffer laid out like the bucket takes the update in
    place of the parameters (0/1 Adam's staged sync). The one guarded Adam update of 1-bit
    and 0/1 Adam; every unguarded element has the bits of ``addcdiv(m, d)``."""
    d_guard = None  # d, with the guarded elements rewritten (the whole bucket, kept)
    for (seg, group), step_size, limit in zip(segments, step_sizes, limits, strict=True):
        guarded = limit is not None and not math.isinf(limit)
        where = guarded_elements(step_guard, state, seg) if guarded else None
        d_seg = d
        if where is not None:
            if d_guard is None:
                d_guard = state.guard_denominator_base(d)
            d_seg = d_guard
            sl = seg.slice
            guarded_denominator(d_seg[sl], m[sl], d[sl], limit, where, copy=False)
        params = seg.params if target is None else seg.views(target)
        wd = group["weight_decay"]
        adam_update_(params, seg.views(m), seg.views(d_seg), group["lr"], wd, step_size)
