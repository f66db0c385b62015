"""What an algorithm tells its early work: the :class:`Kind` of a bucket's next step, and how
to exchange it (the :class:`EarlyPlan` protocol)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from commopt.optim.early._staged import StagedBuffers
    from commopt.optim.flat_state import FlatState

__all__ = ["EarlyPlan", "Kind", "WarmupThenMomentum"]


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
        del staged
        self._exchange(state, m, errors, step)

    def snapshot(self) -> None:
        return None
