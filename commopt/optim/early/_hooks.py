"""``overlap=True``: a bucket's communication runs during backward, on a communication thread.

As soon as a parameter's gradient is accumulated (``Tensor.register_post_accumulate_grad_hook``)
its part of the step's early work starts on the main thread: the gradient is copied into the
warmup's staged gradient, or folded into a staged momentum (:class:`~.EarlyWork`, shared with
the DDP hook). Once an optimizer bucket is complete, its collective work — the warmup's
full-precision average, or the compression stage's 1-bit exchange — is queued on the
optimizer's :class:`~commopt.optim.early.CommThread`, which runs it while backward goes on. The
thread runs buckets strictly in the *exchange order* (reverse layout order at first, since
gradients become ready from the last layer back; from the second step on, the order in which
rank 0 saw them complete at the first step), so every rank issues the same collectives in the
same order. ``step()`` first drains the thread (raising any error of its jobs), then agrees on
the gradients and commits the staged work, or drops it if the step is skipped.

The hooks own their handles and two switches; the staged work belongs to the optimizer's
:class:`~.EarlyWork`, which they reach through the getter they are given (a loaded state dict
builds the early work anew).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from commopt.optim.early._plan import Kind

if TYPE_CHECKING:
    from commopt.optim.early._work import EarlyWork

__all__ = ["GradientHooks"]


class GradientHooks:
    """The per-parameter gradient hooks of one optimizer (``overlap=True``)."""

    def __init__(self, work: Callable[[], EarlyWork]) -> None:
        self._work = work
        #: hooks were requested (``overlap=True``)
        self.enabled = False
        #: inside ``no_sync()``: a backward pass starts nothing
        self.paused = False
        self._handles: list[Any] = []

    def enable(self, params: Sequence[torch.Tensor]) -> None:
        self.enabled = True
        self.attach(params)

    def attach(self, params: Sequence[torch.Tensor]) -> None:
        # The parameters outlive an optimizer often enough (a new optimizer per phase): the hook
        # holds it weakly, so a dropped optimizer is collected and its thread stopped.
        ref = weakref.WeakMethod(self._ready)

        def ready(p: torch.Tensor) -> None:
            method = ref()
            if method is not None:
                method(p)

        for p in params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(ready))

    @torch.no_grad()
    def _ready(self, p: torch.Tensor) -> None:
        if self.paused or p.grad is None or p.grad.is_sparse:
            return
        work = self._work()
        kind = work.plan([p])[0]
        if kind == Kind.AVERAGE and work.locate(p) is not None:
            work.average([p], [p.grad], last=False, threaded=True)
        elif kind in (Kind.MOMENTUM, Kind.GRADIENT, Kind.SYNC):
            work.fold([p], [p.grad], threaded=True)
