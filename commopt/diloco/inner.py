"""The inner optimizer's step, taken inside DiLoCo's.

torch runs its global step hooks (``torch.optim.optimizer.register_optimizer_step_pre_hook``
and ``..._post_hook``) around every ``Optimizer.step``. The training loop steps one optimizer,
DiLoCo, whose step runs them; the inner step inside it is part of that step, so it runs without
them, and torch's own optimizer tests see one step per step (``TestOptimRenewed``'s
``test_step_all_hooks``, ported in tests/torch_optim_port.py). Hooks registered on the inner
optimizer object itself do not run either: register them on DiLoCo.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["step_inner"]


def step_inner(inner: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    """``inner.step(closure)`` without torch's step hooks: the step torch's wrapper wraps,
    unless ``step`` was replaced on the object itself (an LR scheduler built on the inner
    optimizer counts its calls that way), which is then called as it is."""
    own = getattr(type(inner).step, "__wrapped__", None)
    if own is None or "step" in vars(inner):
        return inner.step() if closure is None else inner.step(closure)
    return own(inner) if closure is None else own(inner, closure)
