"""The inner optimizer's step, taken inside DiLoCo's.

torch runs its global step hooks (``torch.optim.optimizer.register_optimizer_step_pre_hook``
and ``..._post_hook``) around every ``Optimizer.step``. The training loop steps one optimizer,
DiLoCo, whose step runs them; the inner step inside it is part of that step, so it runs without
them, and torch's own optimizer tests see one step per step (``TestOptimRenewed``'s
``test_step_all_hooks``, ported in tests/torch_optim_port.py). Hooks registered on the inner
optimizer object itself do not run either: register them on DiLoCo.

Under ``torch.amp.GradScaler``, :func:`scaled_step_inner` takes it: an overflow skips the inner
step of the rank that saw it, and the call still counts toward the syncs (docs/production.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from commopt.optim.adam import unscale_grads_

__all__ = ["scaled_step_inner", "step_inner"]


def step_inner(inner: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    """``inner.step(closure)`` without torch's step hooks: the step torch's wrapper wraps,
    unless ``step`` was replaced on the object itself (an LR scheduler built on the inner
    optimizer counts its calls that way), which is then called as it is."""
    own = getattr(type(inner).step, "__wrapped__", None)
    if own is None or "step" in vars(inner):
        return inner.step() if closure is None else inner.step(closure)
    return own(inner) if closure is None else own(inner, closure)


def scaled_step_inner(
    inner: torch.optim.Optimizer,
    params: list[torch.Tensor],
    scale: torch.Tensor | None,
    found_inf: torch.Tensor,
    average: Callable[[bool], bool] | None,
) -> tuple[Any, bool]:
    """The inner step under ``GradScaler.step`` (``scale``: this rank's, or None once
    ``scaler.unscale_`` ran; ``found_inf``: GradScaler's verdict on this rank's gradients), and
    whether it was skipped. The gradients are unscaled by this rank's own scale and the step is
    skipped where they hold an inf/NaN: on this rank alone (its own data), or, when
    ``average`` averages them first (warmup, islands; it takes this rank's verdict and returns
    every rank's), on every rank that averaged them. A fused torch optimizer or a commopt one
    gets the scale and the verdict and unscales and skips itself. On FSDP2 shards GradScaler's
    check of the DTensor gradients already agrees over the shard group: a replica skips whole.
    """
    skip = bool(found_inf.sum() > 0)
    if average is not None:  # unscaled before averaging: each rank's scale is its own
        if scale is not None:
            unscale_grads_(params, scale)
            scale = None
        skip = average(skip)  # an inf on any rank: every rank skips
        found_inf = torch.full_like(found_inf, float(skip))
    own: Any = inner
    if getattr(own, "_step_supports_amp_scaling", False):
        own.grad_scale, own.found_inf = scale, found_inf
        try:
            return step_inner(inner), skip
        finally:
            del own.grad_scale, own.found_inf
    if scale is not None:
        unscale_grads_(params, scale)
    return (None if skip else step_inner(inner)), skip
