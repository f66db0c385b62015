"""Where DiLoCo's outer loop stands, and the defaults of its schedule: :class:`Progress` (the
counters and the syncs in flight, which the state dict saves), the outer SGD's defaults per
compression and how many of the first syncs run at fp32 (docs/algorithms/diloco.md has the
experiments behind each number)."""

from __future__ import annotations

import concurrent.futures
import dataclasses

import torch

from commopt.choices import Compression

__all__ = ["FP32_START", "OUTER_DEFAULTS", "Progress", "default_fp32_syncs"]


@dataclasses.dataclass
class Progress:
    """Where the outer loop stands: the state :class:`~commopt.diloco.DiLoCo` keeps beside its
    fragments."""

    step: int = 0
    """inner steps taken"""
    syncs: int = 0
    """fragment averages run"""
    fp32_syncs_run: int = 0
    """of which at fp32 by ``fp32_syncs``"""
    bytes: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"sync": 0, "fp32": 0, "warmup": 0, "local": 0}
    )
    """modelled bytes sent, by what sent them (:meth:`DiLoCo.comm_stats`; ``"fp32"``: the part
    of ``"sync"`` sent by the first ``fp32_syncs`` syncs)"""
    pending: dict[int, tuple[concurrent.futures.Future[torch.Tensor], int]] = dataclasses.field(
        default_factory=dict
    )
    """fragment → (its average in flight, the step after which it is applied)"""
    last_sync: list[int] = dataclasses.field(default_factory=list)
    """per fragment, the step whose pseudo-gradient was last averaged (the warmup's end: W)"""
    skipped: int = 0
    """inner steps skipped for an inf/NaN gradient under ``GradScaler`` (they still count)"""


#: (outer_lr, outer_momentum) per compression when not given (docs/algorithms/diloco.md)
OUTER_DEFAULTS: dict[str, tuple[float, float]] = {
    "onebit": (1.3, 0.0),
    "none": (1.3, 0.0),
    "bf16": (1.3, 0.0),
}


#: with ``compression="onebit"`` and ``fp32_syncs=None``, the syncs within the first this many
#: inner steps, and at least two, average at fp32 (docs/algorithms/diloco.md, "The first syncs
#: in fp32")
FP32_START = 50


def default_fp32_syncs(compression: Compression, sync_every: int) -> int:
    """What ``fp32_syncs=None`` means: max(2, ⌈FP32_START / H⌉) with ``"onebit"`` (5 at
    H = 10, 3 at H = 20, 2 at H ≥ 25), 0 with ``"none"`` and ``"bf16"``, whose syncs are not
    1-bit anyway."""
    return max(2, -(-FP32_START // sync_every)) if compression == "onebit" else 0
