"""``overlap=True``: a bucket's communication runs during backward, on a communication thread.

As soon as a parameter's gradient is accumulated (``Tensor.register_post_accumulate_grad_hook``)
its part of the step's early work starts on the main thread: the gradient is copied into the
warmup's staged gradient, or folded into a staged momentum (:mod:`commopt.optim.early`, shared
with the DDP hook). Once an optimizer bucket is complete, its collective work — the warmup's
full-precision average, or the compression stage's 1-bit exchange — is queued on the
optimizer's :class:`~commopt.optim.comm_thread.CommThread`, which runs it while backward goes
on. The thread runs buckets strictly in the *exchange order* (reverse layout order at first,
since gradients become ready from the last layer back; from the second step on, the order in
which rank 0 saw them complete at the first step), so every rank issues the same collectives
in the same order. ``step()`` first drains the thread (raising any error of its jobs), then
agrees on the gradients and commits the staged work, or drops it if the step is skipped.

The hooks own their handles, two switches and the thread; the staged work belongs to the
optimizer's :class:`~commopt.optim.early.EarlyWork`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from commopt.comm.channels import open_channel
from commopt.optim.comm_thread import CommThread
from commopt.optim.early import EarlyWork
from commopt.optim.early_kind import Kind
from commopt.optim.flat_state import FlatState

if TYPE_CHECKING:
    from commopt.optim.base import CompressedOptimizer

__all__ = ["BackwardWork", "GradientHooks"]


class GradientHooks:
    """The per-parameter gradient hooks of one optimizer (``overlap=True``)."""

    def __init__(self, optimizer: CompressedOptimizer) -> None:
        self._opt = optimizer
        #: hooks were requested (``overlap=True``)
        self.enabled = False
        #: inside ``no_sync()``: a backward pass starts nothing
        self.paused = False
        self._handles: list[Any] = []
        self._thread: CommThread | None = None

    @property
    def thread(self) -> CommThread:
        """The optimizer's communication thread (created at first use; the OS thread itself
        starts at the first job, and is stopped and joined when the optimizer is collected or
        at interpreter exit)."""
        if self._thread is None:
            self._thread = CommThread(f"commopt-{type(self._opt).__name__}")
            weakref.finalize(self._opt, self._thread.close)
        return self._thread

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
        work = self._opt.early_work
        kind = work.plan([p])[0]
        if kind == Kind.AVERAGE and work.locate(p) is not None:
            work.average([p], [p.grad], last=False, threaded=True)
        elif kind in (Kind.MOMENTUM, Kind.GRADIENT, Kind.SYNC):
            work.fold([p], [p.grad], threaded=True)


class BackwardWork:
    """The part of :class:`~commopt.optim.base.CompressedOptimizer` that lets a bucket's work
    start during backward — from a DDP communication hook (:mod:`commopt.ddp`) or from the
    gradient hooks above (``overlap=True``) — and hands it to the algorithm in ``step()``.

    An algorithm opts in per bucket and step through :meth:`_early_kind` and consumes the work
    through :meth:`_averaged_grads` and :meth:`_take_exchanged_momentum`.
    """

    _early: EarlyWork | None
    _hooks: GradientHooks
    _step_now: int
    _bucket_numel: int | None

    if TYPE_CHECKING:  # defined by CompressedOptimizer, which this mixin is part of

        def _average(self, flat: torch.Tensor) -> torch.Tensor: ...

        def _compress(
            self, state: FlatState, flat: torch.Tensor, comm: dict[str, torch.Tensor] | None = None
        ) -> torch.Tensor: ...

    @property
    def early_work(self) -> EarlyWork:
        """Work a DDP communication hook started on this optimizer's buckets during backward,
        staged until ``step()`` takes or skips the step (:mod:`commopt.optim.early`)."""
        if self._early is None:
            self._early = EarlyWork(self)
        return self._early

    def _early_kind(self, state: FlatState, step: int) -> Kind | None:
        """What of step ``step`` may start during backward for this bucket: a
        :class:`~commopt.optim.early_kind.Kind` (see :mod:`.early`) or None (nothing: ``step()``
        communicates). An algorithm that returns a kind must consume it:
        :meth:`_averaged_grads`, :meth:`_take_exchanged_momentum`,
        :meth:`_take_exchanged_gradient`."""
        del state, step
        return None

    def _averaged_grads(self, state: FlatState) -> torch.Tensor:
        """The bucket's gradients averaged over all ranks at full precision, flat, in scratch
        ``"grad"``; those a DDP hook already averaged are not averaged again."""
        g = state.scratch("grad")
        if self._overlap and self._early is not None:  # p.grad is local; the average is staged
            staged = self._early.averaged_gradient(state, self._step_now)
            if staged is not None:
                return g.copy_(staged)
        state.gather_grads(g)
        done = set() if self._early is None else self._early.averaged(state, self._step_now)
        if len(done) == len(state.bucket.params):
            return g
        self._average(g)
        for i in done:  # a bucket partly outside the DDP model: restore what was averaged
            p, start = state.bucket.params[i], state.bucket.offsets[i]
            g[start : start + p.numel()].copy_(p.grad.reshape(-1))
        return g

    #: a parameter without a gradient folds as g = 0 through ``lerp`` (1-bit LAMB's
    #: ``gather_grads``), not as m·β1 (1-bit Adam's ``momentum_from_grads_``)
    _fold_missing_as_zero = False

    def _early_exchange(
        self, state: FlatState, m: torch.Tensor, errors: dict[str, torch.Tensor], step: int
    ) -> None:
        """The compressed exchange of a staged momentum m' (in place) with the staged error
        buffers, for step ``step``: what the algorithm's ``step()`` would run on m'. 1-bit
        Adam: the exchange itself; 1-bit LAMB scales by σ around it."""
        del step
        self._compress(state, m, errors)

    def _hyperparameters(self) -> object:
        """What staged work reads from ``param_groups``, taken on the main thread when a
        bucket's job is queued (0/1 Adam's syncs: :mod:`.zero_one_sync`); None: nothing."""
        return None

    def _take_exchanged_momentum(self, state: FlatState) -> bool:
        """Commit the momentum a DDP hook folded and exchanged for this bucket into
        ``exp_avg`` (and its error buffers); False: none was, the algorithm does it now."""
        return self._early is not None and self._early.take_momentum(state, self._step_now)

    def _take_exchanged_gradient(self, state: FlatState) -> torch.Tensor | None:
        """The bucket's local gradient exchanged at one bit during backward (``"gradient"``),
        its error buffers committed; None: it was not, the algorithm does it now."""
        if self._early is None:
            return None
        return self._early.take_gradient(state, self._step_now)

    # -- overlap: the same early work, started from each parameter's gradient hook ------------
    @property
    def _overlap(self) -> bool:
        return self._hooks.enabled

    def _start_overlap(self) -> None:
        """Start each bucket's work during backward (``overlap=True``; :mod:`.overlap`), its
        collectives on a channel of their own, opened here: collectively, while every rank
        builds the optimizer (not at the first job, which a rank that skips that backward pass
        would never reach)."""
        self._hooks.enable([p for g in self.param_groups for p in g["params"]])
        thread = self._hooks.thread
        thread.channel, closer = open_channel(self.backend)
        if closer is not None:  # freed with the thread (the optimizer is dropped)
            thread.on_close.append(closer)

    def _set_overlap(self, overlap: bool, bucket_numel: int | None) -> None:
        """The constructor's ``overlap`` and ``bucket_numel`` (None: the class's layout),
        checked; called once ``param_groups`` exist, before the buckets are laid out."""
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be True or False, got {overlap!r}")
        if bucket_numel is not None:
            if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int):
                raise TypeError(f"bucket_numel must be an int, got {type(bucket_numel).__name__}")
            if bucket_numel < 1:
                raise ValueError(f"Invalid bucket_numel: {bucket_numel} (must be >= 1)")
            self._bucket_numel = bucket_numel
        if overlap:
            self._start_overlap()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside start no communication (gradient accumulation with
        ``overlap=True``: every pass but the last before ``step()``), like DDP's ``no_sync``."""
        previous, self._hooks.paused = self._hooks.paused, True
        try:
            yield
        finally:
            self._hooks.paused = previous
