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
  starts its average as soon as the bucket is complete (:meth:`EarlyWork.average`); the DDP
  bucket receives the averaged values, so they become ``p.grad``, and ``step()`` only has to
  know not to average them again (:meth:`EarlyWork.averaged`). An average of ``p.grad`` is
  nothing ``step()`` could still undo, so nothing else is staged.
- :attr:`Kind.MOMENTUM`: the step folds this rank's gradient into the momentum and averages the
  momentum at one bit (1-bit Adam's compression stage). The hook computes
  m' = β1·m + (1−β1)·g from the committed m into a *staged momentum* m', and once every
  parameter of the optimizer bucket is folded, runs the compressed exchange on m' with *staged
  error buffers* (copies of e and f). ``step()`` copies m' into m and swaps the staged error
  buffers in (:meth:`EarlyWork.take_momentum`), or drops everything when the step is skipped.
  1-bit LAMB's compression stage is the same fold, its exchange scaled by σ around it
  (its plan's ``exchange``).
- :attr:`Kind.GRADIENT`: the step exchanges this rank's gradient at one bit (0/1 Adam's 1-bit
  steps). The hook copies g into the same staged buffer as a momentum and exchanges it once
  the bucket is complete, on staged error buffers; ``step()`` takes the exchanged gradient
  (:meth:`EarlyWork.take_gradient`) and swaps the staged error buffers in.

The exchange always runs on the optimizer's own buckets, never on DDP's: the compressed
average of a buffer depends on its layout (one scale per buffer, server chunks), so working
on the optimizer's layout makes the result bit-identical to the standalone optimizer however
DDP groups the parameters, and keeps the error buffers where they always were (the
optimizer's ``state_dict()``).

With ``overlap=True`` (:class:`GradientHooks`) the same staged work starts from
per-parameter gradient hooks instead of DDP, and its averages and exchanges run on the
optimizer's communication thread in a fixed exchange order
(:class:`ExchangeSchedule`). What is staged, and what it costs in memory:
:class:`StagedBuffers`.

The pieces, each owning its state: :class:`EarlyWork` (the staged work; it takes the
optimizer's layout, its communication, a thread and the algorithm's :class:`EarlyPlan`, never
the optimizer), :class:`StagedBuffers`, :class:`EarlyReads`, :class:`ExchangeSchedule`,
:class:`CommThread` and :class:`GradientHooks`. 0/1 Adam's staged sync (:attr:`Kind.SYNC`) is
its plan's exchange, in :mod:`commopt.optim.zero_one_adam`.
"""

from commopt.optim.early._hooks import GradientHooks
from commopt.optim.early._order import ExchangeSchedule
from commopt.optim.early._plan import EarlyPlan, Kind, WarmupThenMomentum
from commopt.optim.early._reads import EarlyReads, after_ddp_backward
from commopt.optim.early._staged import StagedBuffers, StagedWork
from commopt.optim.early._thread import CommThread
from commopt.optim.early._work import EarlyWork

__all__ = [
    "CommThread",
    "EarlyPlan",
    "EarlyReads",
    "EarlyWork",
    "ExchangeSchedule",
    "GradientHooks",
    "Kind",
    "StagedBuffers",
    "StagedWork",
    "WarmupThenMomentum",
    "after_ddp_backward",
]
