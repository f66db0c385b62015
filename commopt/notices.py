"""What commopt tells the user: warnings that point at the user's line (their ``step()``
call), not at commopt or torch, and the notices of a step skipped, redone or compressing."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "log_compression_started",
    "sync_point_not_finite",
    "warn_at_caller",
    "warn_averaged_already",
    "warn_redone",
    "warn_skipped",
    "warn_sync_diverged",
]

_INTERNAL_DIRS = tuple(
    str(path) + os.sep
    for path in (Path(__file__).resolve().parent, Path(torch.__file__).resolve().parent)
)


def _internal(frame: Any) -> bool:
    """A frame of commopt or torch: by file, or by module for code without a file of its own
    (the ``__init__`` a dataclass generates runs in its module's globals)."""
    module = frame.f_globals.get("__name__", "")
    return frame.f_code.co_filename.startswith(_INTERNAL_DIRS) or module.split(".")[0] in (
        "commopt",
        "torch",
    )


def warn_at_caller(message: str) -> None:
    """``warnings.warn`` attributed to the first frame outside commopt and torch: the line of
    the user's code that called ``step()``, not an internal helper or torch's no_grad wrapper."""
    frame, level = sys._getframe(1), 2
    while frame is not None and _internal(frame):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)


def warn_skipped(name: str, step: int, why: str, collective: bool, rank: int) -> None:
    """Say that optimizer ``name`` skipped step ``step`` and why: on every rank (``collective``)
    or, for a purely local step, only this rank's update."""
    if collective:
        what = f"{why} on at least one rank at step {step}; the step is skipped on every "
        what += "rank and no state changed"
    else:
        what = (
            f"{why} on rank {rank} at local step {step}; this rank's local "
            "update is dropped (the step communicates nothing) and the next sync reconciles "
            "the replicas"
        )
    warn_at_caller(f"{name}: {what}")


def warn_averaged_already(name: str, rank: int) -> None:
    """On rank 0: the gradients were already bit-identical on every rank before optimizer
    ``name`` communicated, which is what a DistributedDataParallel model without commopt's
    communication hook hands it."""
    if rank != 0:
        return
    warn_at_caller(
        f"{name}: the gradients are already identical on every rank before it communicates. "
        "Is the model wrapped in DistributedDataParallel without commopt's hook? DDP then "
        "averages every gradient in full precision and the optimizer exchanges them again: more "
        "traffic than DDP alone, and not the optimizer's algorithm. Register the hook: "
        "model.register_comm_hook(commopt.ddp.OnebitHookState(optimizer), "
        "commopt.ddp.onebit_hook). (If every rank really trains on the same data, ignore this.)"
    )


_redone: set[str] = set()


def warn_redone(name: str, why: str | None, rank: int, overlap: bool = True) -> None:
    """Once per optimizer class and process, on rank 0: the early work of a step
    (``overlap=True``'s, or the DDP hook's) was redone in ``step()`` because what it read
    changed after backward."""
    if rank != 0 or name in _redone:
        return
    _redone.add(name)
    if overlap:
        warn_at_caller(
            f"{name}: {why or 'on another rank, what overlap=True read changed after backward'}; "
            "the step was redone as overlap=False would (same result, the communication paid "
            "twice). From now on this optimizer leaves that work to step(), i.e. runs as "
            "overlap=False. Change gradients or beta1 before backward ends to keep the overlap "
            "(docs/overlap.md)"
        )
        return
    warn_at_caller(
        f"{name}: {why or 'on another rank, what the DDP hook read changed after backward'}; "
        "the step was redone as the standalone optimizer would (same result, the "
        "communication paid twice). From now on the hook leaves the compressed exchange to "
        "step() (the same result, paid once, no longer during backward). Change gradients or "
        "beta1 before backward ends to keep it in backward (docs/ddp.md)"
    )


def log_compression_started(name: str, step: int, rank: int) -> None:
    """On rank 0, once per optimizer (the caller keeps the flag): the first 1-bit exchange."""
    if rank == 0:
        logging.getLogger("commopt").info(
            "%s: compression started at step %d (1-bit exchanges from now on)", name, step
        )


def warn_sync_diverged() -> None:
    """0/1 Adam: a sync step found non-finite parameters and every rank went back to p_sync."""
    warn_at_caller(
        "ZeroOneAdam: non-finite parameters at a sync step on at least one rank (a replica "
        "diverged since the last sync: too large a step, or a weight set to inf/NaN); every "
        "rank returns to the last synced parameters there (p = p_sync, m = 0)"
    )


def sync_point_not_finite(ranks: list[int], step: int) -> str:
    """0/1 Adam: the message when the point a failed sync returns to is not finite itself."""
    return (
        f"ZeroOneAdam: step {step} is a sync at which some replica's parameters are inf/NaN, "
        f"and the last synced parameters (p_sync) or the frozen variance are inf/NaN on "
        f"rank(s) {ranks} as well, so returning there cannot recover: every later sync would "
        "fail the same way. They were non-finite before this phase-B interval began (a "
        "weight set or loaded as inf/NaN, or a full-precision step that overflowed). Resume "
        "from an earlier checkpoint, and lower the learning rate or find the non-finite weight"
    )
