r"""Work on a bucket that starts before ``step()``, staged until every rank accepts the step.

A DDP communication hook (:mod:`commopt.ddp`) runs while backward is still going, once per DDP
bucket, and can start an optimizer bucket's communication there. But a step may still be
skipped afterwards: a non-finite gradient on any rank skips it on every rank, with every
buffer untouched, and that verdict exists only in ``step()``. So nothing started early may
change the optimizer's state; it is *staged*, and ``step()`` commits or drops it.

The kinds of early work, named by the algorithm for each bucket and step
(its :class:`EarlyPlan`):

- :attr:`Kind.AVERAGE`: the step averages the gradient at full precision (1-bit Adam's warmup). The
  hook copies the gradients into a *staged gradient* laid out like the optimizer bucket and
  starts its average as soon as the bucket is complete (:meth:`~._work.EarlyWork.average`); the DDP
  bucket receives the averaged values, so they become ``p.grad``, and ``step()`` only has to
  know not to average them again (:meth:`~._work.EarlyWork.averaged`). An average of ``p.grad`` is
  nothing ``step()`` could still undo, so nothing else is staged.
- :attr:`Kind.MOMENTUM`: the step folds this rank's gradient into the momentum and averages the
  momentum at one bit (1-bit Adam's compression stage). The hook computes m' = β1·m + (1−β1)·g
  from the committed m into a *staged momentum* m', and once every parameter of the optimizer
  bucket is folded, runs the compressed exchange on m' with *staged error buffers* (copies of e
  and f). ``step()`` copies m' into m and swaps the staged error buffers in
  (:meth:`~._work.EarlyWork.take_momentum`), or drops everything when the step is skipped. 1-bit
  LAMB's compression stage is the same fold, its exchange scaled by σ around it (its plan's
  ``exchange``).
- :attr:`Kind.GRADIENT`: the step exchanges this rank's gradient at one bit (0/1 Adam's 1-bit
  steps). The hook copies g into the same staged buffer as a momentum and exchanges it once
  the bucket is complete, on staged error buffers; ``step()`` takes the exchanged gradient
  (:meth:`~._work.EarlyWork.take_gradient`) and swaps the staged error buffers in.

The exchange always runs on the optimizer's own buckets, never on DDP's: the compressed
average of a buffer depends on its layout (one scale per buffer, server chunks), so working
on the optimizer's layout makes the result bit-identical to the standalone optimizer however
DDP groups the parameters, and keeps the error buffers where they always were (the
optimizer's ``state_dict()``).

With ``overlap=True`` (:class:`~._thread.GradientHooks`) the same staged work starts from
per-parameter gradient hooks instead of DDP, and its averages and exchanges run on the
optimizer's communication thread in a fixed exchange order
(:class:`~._thread.ExchangeSchedule`). What is staged, and what it costs in memory:
:class:`StagedBuffers`.

The pieces, each owning its state: here, the contract between an algorithm and its early
work (:class:`Kind`, :class:`EarlyPlan`) and what the work writes (:class:`StagedBuffers`);
in :mod:`._work`, the staged work itself (:class:`~._work.EarlyWork`: it takes the
optimizer's layout, its communication, a thread and the algorithm's :class:`EarlyPlan`, never
the optimizer) and what it read (:class:`~._work.EarlyReads`); in :mod:`._thread`, the
communication thread, its exchange order and the gradient hooks of ``overlap=True``
(:class:`~._thread.CommThread`, :class:`~._thread.ExchangeSchedule`,
:class:`~._thread.GradientHooks`). 0/1 Adam's staged sync (:attr:`Kind.SYNC`) is its plan's
exchange, in :mod:`commopt.optim._zero_one`.

What an algorithm tells its early work: the :class:`Kind` of a bucket's next step, and how
to exchange it (the :class:`EarlyPlan` protocol).

What the early work writes instead of the optimizer's state, and how a gradient goes into it
(:func:`fold_param_`). :class:`StagedWork` is one optimizer bucket's progress for one step
(which gradients arrived, were averaged or folded; whether its exchange ran);
:class:`StagedBuffers` are the buffers that work writes, kept from step to step.

Memory, per optimizer bucket of L elements, allocated at first use and kept: a staged gradient
(L fp32) in steps with ``AVERAGE`` work; a staged momentum (L fp32) and staged error buffers (N
+ N/n fp32 for the flat exchange, N = L padded) in steps with ``MOMENTUM`` work. So about 4
bytes per parameter in the warmup and (2 + 1/n)·4 bytes in the compression stage (0/1 Adam's
staged syncs: a staged p′ too, so (3 + 1/n)·4 bytes), on top of the optimizer's own m, v, e
and f.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from commopt.optim.flat_state import FlatState

__all__ = ["EarlyPlan", "Kind", "StagedBuffers", "StagedWork", "WarmupThenMomentum", "fold_param_"]


class Kind(str, enum.Enum):
    """The kinds of early work (a ``str`` enum: each member equals its value)."""

    #: the step averages the gradient at full precision; the hook may do it
    AVERAGE = "average"
    #: the step folds the local gradient into the momentum and exchanges the momentum at 1 bit
    MOMENTUM = "momentum"
    #: the step exchanges this rank's gradient at one bit; the hook may do it on a staged copy
    GRADIENT = "gradient"
    #: 0/1 Adam's phase-B sync, staged during backward (``overlap=True`` only)
    SYNC = "sync"


class EarlyPlan(Protocol):
    """An algorithm's side of the early work, implemented beside the algorithm.

    The early work owns the staged buffers and when things run; the plan owns what they
    mean. Nothing the plan returns may depend on anything but the committed state and the
    arguments: every rank must plan alike.
    """

    #: a parameter without a gradient folds as g = 0 through ``lerp`` (True), or as m·β1
    fold_missing_as_zero: bool

    def kind(self, state: FlatState, step: int) -> Kind | None:
        """What of step ``step`` may start during backward for this bucket; None: nothing
        (``step()`` communicates, or nothing is sent)."""
        ...

    def exchange(
        self,
        state: FlatState,
        m: torch.Tensor,
        errors: dict[str, torch.Tensor],
        step: int,
        staged: StagedBuffers,
    ) -> object:
        """The exchange of step ``step`` on the bucket's staged m′ (in place), with the staged
        error buffers ``errors``: what ``step()`` would run on m′. May raise
        :class:`~commopt.compressed.NonFiniteError` (on every rank alike). What it returns is
        kept with the bucket's staged work (:attr:`StagedWork.outcome`)."""
        ...

    def snapshot(self) -> object:
        """What staged work reads from the hyperparameters, taken on the main thread when a
        bucket's job is queued (compared in ``step()``); None: nothing."""
        ...


class WarmupThenMomentum:
    """The plan of 1-bit Adam and 1-bit LAMB: the warmup's gradient average (:attr:`Kind.AVERAGE`)
    and, after it, the momentum folded and exchanged at one bit (:attr:`Kind.MOMENTUM`), both
    functions of the gradient and the committed state alone.

    A bucket's parameters warm up from the step they joined at (``bucket.first_step``).

    Args:
        frozen_after: the last warmup step, as it is now.
        exchange: ``exchange(state, m, errors, step)``, the algorithm's exchange of a staged m′.
        fold_missing_as_zero: see :class:`EarlyPlan`.
    """

    def __init__(
        self,
        frozen_after: Callable[[], float],
        exchange: Callable[[FlatState, torch.Tensor, dict[str, torch.Tensor], int], None],
        fold_missing_as_zero: bool,
    ) -> None:
        self._frozen_after, self._exchange = frozen_after, exchange
        self.fold_missing_as_zero = fold_missing_as_zero

    def kind(self, state: FlatState, step: int) -> Kind:
        """AVERAGE through the bucket's warmup, MOMENTUM after it."""
        t = step - state.bucket.first_step  # a group added later runs its own warmup
        return Kind.AVERAGE if t <= self._frozen_after() else Kind.MOMENTUM

    def exchange(
        self,
        state: FlatState,
        m: torch.Tensor,
        errors: dict[str, torch.Tensor],
        step: int,
        staged: StagedBuffers,
    ) -> None:
        """The algorithm's exchange of the staged m′."""
        del staged
        self._exchange(state, m, errors, step)

    def snapshot(self) -> None:
        """Nothing: the exchange reads no hyperparameter."""
        return None


class StagedWork:
    """One optimizer bucket's early work for one step."""

    __slots__ = (
        "arrived",
        "averaged",
        "exchanged",
        "failed",
        "folded",
        "future",
        "outcome",
        "round",
        "seen",
        "step",
        "ticket",
    )

    def __init__(self, step: int, round_: int) -> None:
        self.step = step
        self.reset(round_)

    def reset(self, round_: int) -> None:
        """Start the bucket over (a later backward pass of the same step)."""
        self.round = round_  # the backward pass (overlap's rounds of tickets) it belongs to
        self.ticket: int | None = None  # its job's ticket on the communication thread
        self.arrived: set[int] = set()  # parameter indices whose gradient is in the staged g
        self.future: torch.futures.Future[torch.Tensor] | None = None  # the staged g's average
        self.averaged: set[int] = set()  # bucket parameter indices whose gradient arrived averaged
        self.folded: set[int] = set()  # parameter indices whose local gradient is in the staged m
        self.exchanged = False  # the staged m has been through the compressed exchange
        self.failed = False  # ... which found non-finite values on some rank (collective)
        self.outcome: object = None  # what the plan's exchange returned (0/1 Adam's sync)
        self.seen: object = None  # the hyperparameters when its job was queued (overlap)


class StagedBuffers:
    """Per optimizer bucket: the staged gradient, momentum and error buffers (see the module
    docstring for what they cost)."""

    def __init__(self) -> None:
        self._gradient: dict[int, torch.Tensor] = {}  # id(FlatState) → staged gradient
        self._momentum: dict[int, torch.Tensor] = {}  # id(FlatState) → staged m
        self._errors: dict[int, dict[str, torch.Tensor]] = {}  # id(FlatState) → staged e, f
        self._base: dict[int, torch.Tensor] = {}  # id(FlatState) → 0/1 Adam's first p_sync

    def gradient(self, state: FlatState) -> torch.Tensor:
        """The bucket's staged gradient, laid out like the bucket."""
        buf = self._gradient.get(id(state))
        if buf is None:
            buf = self._gradient[id(state)] = state.bucket.new_buffer()
        return buf

    def drop_gradient(self, state: FlatState) -> None:
        """Free the bucket's staged gradient (its steps no longer average gradients)."""
        self._gradient.pop(id(state), None)

    def momentum(self, state: FlatState) -> torch.Tensor:
        """The bucket's staged momentum m' (fp32, the bucket's length)."""
        m = self._momentum.get(id(state))
        if m is None:
            bucket = state.bucket
            m = self._momentum[id(state)] = torch.empty(
                bucket.numel, dtype=torch.float32, device=bucket.device
            )
        return m

    def sync_base(self, state: FlatState) -> torch.Tensor:
        """0/1 Adam's staged p_sync at its first phase-B step (:mod:`.zero_one_adam`)."""
        buf = self._base.get(id(state))
        if buf is None:
            buf = self._base[id(state)] = state.bucket.new_buffer()
        return buf

    def errors_from(self, state: FlatState) -> dict[str, torch.Tensor]:
        """Staged copies of the bucket's committed error buffers (``state.comm``)."""
        staged = self._errors.get(id(state))
        if staged is None:
            staged = self._errors[id(state)] = {
                k: torch.empty_like(v) for k, v in state.comm.items()
            }
        for key, buf in state.comm.items():
            staged[key].copy_(buf)
        return staged

    def swap_errors_into(self, state: FlatState) -> None:
        """Commit the staged error buffers: swap, not copy, so the old buffers are the next
        step's staging space."""
        staged = self._errors[id(state)]
        for key in state.comm:
            state.comm[key], staged[key] = staged[key], state.comm[key]

    def clear(self) -> None:
        """Free everything (the buckets were laid out anew)."""
        self._gradient.clear()
        self._momentum.clear()
        self._errors.clear()
        self._base.clear()


def fold_param_(
    state: FlatState,
    i: int,
    g: torch.Tensor | None,
    staged: torch.Tensor,
    groups: Sequence[dict[str, Any]],
    gradient: bool,
    missing_as_zero: bool,
) -> None:
    """The bucket's i-th parameter into ``staged`` (flat, the bucket's layout), bit for bit as
    ``step()`` would: m′ = β1·m + (1−β1)·g from the committed m, or ``gradient`` (0/1 Adam's
    1-bit steps): g itself. ``g`` None: the parameter has no gradient on this rank (m′ = β1·m,
    or with ``missing_as_zero`` the lerp towards 0 of 1-bit LAMB's ``gather_grads``)."""
    bucket = state.bucket
    start = bucket.offsets[i]
    p = bucket.params[i]
    dst = staged[start : start + p.numel()].view(p.shape)
    if gradient:
        if g is None:
            dst.zero_()
        else:
            dst.copy_(g.reshape(p.shape))
        return
    src = state.flat["exp_avg"][start : start + p.numel()].view(p.shape)
    beta1 = next(
        groups[seg.group]["betas"][0] for seg in bucket.segments if any(q is p for q in seg.params)
    )
    # one pass, out of place: the kernels of lerp_/mul_ in step(), so the same bits
    if g is None and missing_as_zero:
        torch.lerp(src, torch.zeros_like(dst), 1 - beta1, out=dst)
    elif g is None:
        torch.mul(src, beta1, out=dst)
    else:
        torch.lerp(src, g.reshape(p.shape).to(dst.dtype), 1 - beta1, out=dst)
