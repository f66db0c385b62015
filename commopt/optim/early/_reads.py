"""What ``overlap=True``'s early work read during backward, so that ``step()`` can tell
whether it still holds (docs/overlap.md, "Changing gradients or β1 after backward").

The early work consumes each gradient as soon as backward produces it, and β1 with it. Between
backward and ``step()`` a program may clip or unscale ``p.grad`` in place, replace it, or let a
scheduler change β1. A gradient tensor's ``_version`` moves with every in-place write, so
keeping (tensor, version) per parameter and the groups' β1 is enough to tell.

Under the DDP hook the work reads DDP's bucket, not ``p.grad``; DDP copies the bucket into
``p.grad`` only when backward ends. So the hook marks the parameter (:meth:`EarlyReads.expect`)
and :meth:`EarlyReads.after_backward` records ``p.grad`` and its version once DDP has written
it (:func:`after_ddp_backward`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["EarlyReads", "after_ddp_backward"]


def after_ddp_backward(fn: Callable[[], None]) -> None:
    """Run ``fn`` at the end of the current backward pass, after DDP has written ``p.grad``.

    Called during backward (from a DDP communication hook). DDP queues its
    ``finalize_backward`` on the autograd engine while backward runs; a callback queued then
    runs before it, but one queued *by* such a callback runs after every callback queued during
    backward, DDP's included.
    """
    engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
    engine.queue_callback(lambda: engine.queue_callback(fn))


class EarlyReads:
    """The gradients (tensor and version) and β1 values one step's early work read."""

    def __init__(self) -> None:
        self._grads: dict[int, tuple[torch.Tensor, int]] = {}  # id(param) → (grad, version)
        self._betas: tuple[float, ...] = ()
        self._step = 0
        self._expected: list[torch.Tensor] = []  # DDP hook: p.grad not written yet

    def note(
        self, p: torch.Tensor, g: torch.Tensor, step: int, groups: Sequence[dict[str, Any]]
    ) -> None:
        """The work of step ``step`` read ``g`` as ``p``'s gradient (β1 is taken at the first
        read of the step)."""
        self._begin(step, groups)
        self._grads[id(p)] = (g, g._version)

    def expect(self, p: torch.Tensor, step: int, groups: Sequence[dict[str, Any]]) -> None:
        """The DDP hook folded ``p``'s gradient for step ``step``; its ``p.grad`` is recorded
        at the end of backward (:meth:`after_backward`)."""
        self._begin(step, groups)
        if not self._expected:
            after_ddp_backward(self.after_backward)
        self._expected.append(p)

    def _begin(self, step: int, groups: Sequence[dict[str, Any]]) -> None:
        """A read for step ``step``: the first of the step forgets the previous step's reads
        and takes the groups' β1."""
        if self._step != step:
            self.clear()
            self._step = step
            self._betas = tuple(group["betas"][0] for group in groups)

    def after_backward(self) -> None:
        """Record ``p.grad`` and its version for every parameter :meth:`expect` named."""
        for p in self._expected:
            if p.grad is not None:
                self._grads[id(p)] = (p.grad, p.grad._version)
        self._expected.clear()

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
        self._expected.clear()
