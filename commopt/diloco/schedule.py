"""What DiLoCo's outer loop is set to and where it stands: :class:`Settings` (fixed for the
run), :class:`Progress` (the counters and the syncs in flight, which the state dict saves), the
outer SGD's defaults per compression and how many of the first syncs run at fp32
(docs/algorithms/diloco.md has the experiments behind each number)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import TypeVar

import torch

from commopt.choices import (
    COMPRESSIONS,
    OUTER_TOPOLOGIES,
    SCALES,
    Compression,
    OuterTopology,
    Scale,
    check_choice,
)
from commopt.optim.config import read_through_fields

__all__ = [
    "FP32_START",
    "OUTER_DEFAULTS",
    "Progress",
    "Settings",
    "default_fp32_syncs",
    "settings_read_through",
]

_T = TypeVar("_T")
_REMEDY = (
    "the schedule, the buffers and the checkpoint's settings are built from it; build the "
    "DiLoCo with {name}=... (a checkpoint with another {name} is refused on load)"
)


@dataclasses.dataclass(frozen=True)
class Settings:
    """The outer loop's settings, as :class:`~commopt.diloco.DiLoCo` was built with them (its
    ``config``; each is also a read-only attribute of the optimizer). They are fixed for the
    run: every rank's schedule, the fragments' buffers and offsets, the average's errors and
    the agreement a checkpoint is checked against are built from them, so assigning one
    afterwards would change the run only in part."""

    sync_every: int
    compression: Compression
    outer_lr: float
    outer_momentum: float
    nesterov: bool
    fragments: int
    delay: int
    warmup_steps: int
    fp32_syncs: int
    topology: OuterTopology
    scale: Scale

    def __post_init__(self) -> None:
        """Check every setting, and resolve the ``None`` defaults of ``outer_lr``,
        ``outer_momentum`` (:data:`OUTER_DEFAULTS`) and ``fp32_syncs``
        (:func:`default_fp32_syncs`)."""
        check_choice("compression", self.compression, COMPRESSIONS)
        check_choice("topology", self.topology, OUTER_TOPOLOGIES)
        check_choice("scale", self.scale, SCALES)
        sync_every, fragments, delay = self.sync_every, self.fragments, self.delay
        for name, value in (("sync_every", sync_every), ("fragments", fragments)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Invalid {name}: {value!r} (an integer >= 1)")
        if fragments > sync_every:
            raise ValueError(
                f"fragments={fragments} needs sync_every >= fragments, got {sync_every}"
            )
        if self.fp32_syncs is None:
            self._resolve("fp32_syncs", default_fp32_syncs(self.compression, sync_every))
        for name in ("warmup_steps", "fp32_syncs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Invalid {name}: {value!r} (an integer >= 0)")
        if not isinstance(delay, int) or not 0 <= delay < max(1, sync_every // fragments):
            raise ValueError(
                f"Invalid delay: {delay!r}; it must be an integer with 0 <= delay < "
                f"sync_every // fragments = {sync_every // fragments}, so that a fragment's "
                "average is applied before the next one starts"
            )
        lr, mu = self.outer_lr, self.outer_momentum
        lr0, mu0 = OUTER_DEFAULTS[self.compression]
        self._resolve("outer_lr", float(lr0 if lr is None else lr))
        self._resolve("outer_momentum", float(mu0 if mu is None else mu))
        if not self.outer_lr > 0.0:
            raise ValueError(f"Invalid outer_lr: {self.outer_lr} (must be > 0)")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"Invalid outer_momentum: {self.outer_momentum} (0 <= μ < 1)")
        self._resolve("nesterov", bool(self.nesterov))

    def _resolve(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)  # (frozen: only while it is being built)


def settings_read_through(cls: _T) -> _T:
    """Give ``cls`` one read-only property per field of :class:`Settings`, read from
    ``self.config``; assigning one raises an ``AttributeError`` that says what to do."""
    return read_through_fields(cls, Settings, _REMEDY)


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
