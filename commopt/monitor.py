"""Log an optimizer's communication statistics every k steps.

``commopt.log_comm_stats(opt, every=100)`` registers a step post-hook (torch's
``register_step_post_hook``) that logs ``opt.comm_stats()`` on the ``commopt.monitor`` logger —
bytes and calls since the previous report, full-precision vs compressed rounds, skipped steps
and the relative compression error of the last compressed call. Nothing is communicated to
produce it: each rank reports its own counters.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["log_comm_stats"]

logger = logging.getLogger(__name__)


def log_comm_stats(
    optimizer: torch.optim.Optimizer,
    every: int = 100,
    *,
    log: logging.Logger | None = None,
    level: int = logging.INFO,
) -> RemovableHandle:
    """Log ``optimizer.comm_stats()`` after every ``every``-th step.

    Args:
        optimizer: a commopt optimizer (anything with ``comm_stats()`` and ``global_state``).
        every: report period in optimizer steps (skipped steps count, as ``step()`` calls).
        log: the logger to use (default ``commopt.monitor``).
        level: the logging level of the reports.

    Returns:
        The hook's handle; ``handle.remove()`` stops the reports.

    Raises:
        ValueError: ``every`` is not a positive integer.
        TypeError: the optimizer has no ``comm_stats()``.
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"Invalid every: {every!r} (must be a positive int number of steps)")
    if not callable(getattr(optimizer, "comm_stats", None)):
        raise TypeError(
            f"log_comm_stats needs a commopt optimizer with comm_stats(), got "
            f"{type(optimizer).__name__}"
        )
    out = log or logger
    state: dict[str, Any] = {"calls": 0, "bytes": 0, "step_calls": 0}

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        del args, kwargs
        state["step_calls"] += 1
        if state["step_calls"] % every:
            return
        stats = opt.comm_stats()  # type: ignore[attr-defined]
        err = stats.get("compression_error")
        out.log(
            level,
            "%s step %d: %d bytes in %d calls over the last %d step() calls (total %d bytes); "
            "rounds full/compressed %d/%d; skipped %d; compression error %s",
            type(opt).__name__,
            opt.global_state["step"],  # type: ignore[attr-defined]
            stats["bytes_sent"] - state["bytes"],
            stats["calls"] - state["calls"],
            every,
            stats["bytes_sent"],
            stats["full_precision_rounds"],
            stats["compressed_rounds"],
            stats["skipped_steps"],
            "n/a" if err is None else f"{err:.3f}",
        )
        state["calls"], state["bytes"] = stats["calls"], stats["bytes_sent"]

    return optimizer.register_step_post_hook(hook)
