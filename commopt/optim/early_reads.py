"""What ``overlap=True``'s early work read during backward, so that ``step()`` can tell
whether it still holds (docs/overlap.md, "Changing gradients or β1 after backward").

The early work consumes each gradient as soon as backward produces it, and β1 with it. Between
backward and ``step()`` a program may clip or unscale ``p.grad`` in place, replace it, or let a
scheduler change β1. A gradient tensor's ``_version`` moves with every in-place write, so
keeping (tensor, version) per parameter and the groups' β1 is enough to tell.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["EarlyReads"]


class EarlyReads:
    """The gradients (tensor and version) and β1 values one step's early work read."""

    def __init__(self) -> None:
        self._grads: dict[int, tuple[torch.Tensor, int]] = {}  # id(param) → (grad, version)
        self._betas: tuple[float, ...] = ()
        self._step = 0

    def note(
        self, p: torch.Tensor, g: torch.Tensor, step: int, groups: Sequence[dict[str, Any]]
    ) -> None:
        """The work of step ``step`` read ``g`` as ``p``'s gradient (β1 is taken at the first
        read of the step)."""
        if self._step != step:
            self.clear()
            self._step = step
            self._betas = tuple(group["betas"][0] for group in groups)
        self._grads[id(p)] = (g, g._version)

    def stale(self, step: int, groups: Sequence[dict[str, Any]]) -> str | None:
        """Why what step ``step``'s work read no longer holds on this rank, or None."""
        if self._step != step or not self._grads:
            return None
        betas = tuple(group["betas"][0] for group in groups)
        if betas[: len(self._betas)] != self._betas:
            return "a param group's beta1 changed after backward"
        params = {id(p): p for group in groups for p in group["params"]}
        for key, (g, version) in self._grads.items():
            p = params.get(key)
            if p is None or p.grad is not g or g._version != version:
                return "a gradient changed after backward (e.g. clip_grad_norm_)"
        return None

    def clear(self) -> None:
        self._grads.clear()
