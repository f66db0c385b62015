"""What of a bucket's next step may start during backward (``CompressedOptimizer._early_kind``).

The DDP hook (:mod:`commopt.ddp`) and ``overlap=True`` (:mod:`commopt.optim.overlap`) ask the
algorithm, per bucket and step, which of these the step does with the bucket's gradient; ``None``
means nothing may start early (``step()`` communicates, or nothing is sent).
"""

from __future__ import annotations

import enum

__all__ = ["Kind"]


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
