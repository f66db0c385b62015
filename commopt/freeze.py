r"""An automatic freeze point: end the full-precision warmup once the variance has settled.

1-bit Adam and 1-bit LAMB freeze their variance v at ``freeze_step`` (0/1 Adam at
``var_freeze_step``); every later step divides by that frozen v. Freeze too early and v is a poor
preconditioner; freeze too late and the full-precision rounds cost what compression was meant to
save. :class:`AutoFreeze` decides from a scalar summary of v that every rank computes from the
same numbers (during warmup v only ever sees averaged gradients, so it is bit-identical on every
rank). The decision therefore needs no message, and every rank takes it at the same step.

The rule (docs/algorithms/auto_freeze.md says why these constants):

    ℓ_t = Σ_k mean(√v̂_k)        (one term per parameter tensor k: each layer counts once)
    r_t = |ℓ_t − ℓ_{t−W}| / ℓ_t  (relative change over the last W observations)
    freeze at the first step t ≥ min_step with r_t ≤ threshold, and at the latest at max_step.

v̂ is the bias-corrected variance. An algorithm that uses v without bias correction (1-bit LAMB,
0/1 Adam) must also wait until v has grown to its level; :func:`settled_step` gives the step
from which √(1 − β2^t) ≥ 1 − threshold, and such an algorithm raises ``min_step`` to it.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any

__all__ = ["AutoFreeze", "FreezePoint", "settled_step", "variance_level"]

logger = logging.getLogger(__name__)


def settled_step(beta2: float, threshold: float) -> int:
    """First number of variance updates t at which uncorrected v is within ``threshold`` of its
    level in the √ sense: √(1 − β2^t) ≥ 1 − threshold (β2 = 0 → 1)."""
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"Invalid beta2: {beta2} (must be in [0, 1))")
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"Invalid threshold: {threshold} (must be in (0, 1))")
    if beta2 == 0.0:
        return 1
    # 1 − β2^t ≥ (1 − τ)²  ⇔  t ≥ ln(1 − (1 − τ)²) / ln β2
    return max(1, math.ceil(math.log(1.0 - (1.0 - threshold) ** 2) / math.log(beta2) - 1e-9))


def variance_level(variances: list[Any], bias_correction: float = 1.0) -> float:
    """ℓ = Σ_k mean(√(v_k / bias_correction)) over the given tensors, in float64.

    Every rank holds the same v and sums in the same order, so every rank gets the same ℓ.
    Empty tensors are skipped.
    """
    total = 0.0
    for v in variances:
        if v.numel():
            total += float(v.double().div(bias_correction).sqrt_().mean())
    return total


class AutoFreeze:
    r"""Decides the freeze step from the variance level ℓ_t observed after each warmup step.

    Args:
        min_step: never freeze before this step. Too low and v̂ is an average of a handful of
            noisy gradients; the default 40 (two windows) is the earliest the rule can compare
            two windows.
        max_step: freeze at this step at the latest, whatever r_t says (default 100000, the
            fixed ``freeze_step`` default of SPEC §2).
        window: W, how many observations back ℓ is compared with. Shorter windows react to
            noise; longer ones delay the decision by about W steps.
        threshold: τ, the largest relative change of ℓ over W observations that counts as
            settled.

    Use: call :meth:`observe` once per step that updated v (in order); it returns True from the
    step at which it froze on. :attr:`frozen_at` is that step (``None`` before). The state
    (window of levels, decision) is saved by :meth:`state_dict` and restored by
    :meth:`load_state_dict`, so a resumed run decides exactly as an uninterrupted one.
    """

    def __init__(
        self,
        min_step: int = 40,
        max_step: int = 100_000,
        window: int = 20,
        threshold: float = 0.05,
    ) -> None:
        for name, value in (("min_step", min_step), ("max_step", max_step), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Invalid {name}: {value!r} (must be an int)")
        if min_step < 1:
            raise ValueError(f"Invalid min_step: {min_step} (must be >= 1)")
        if max_step < min_step:
            raise ValueError(f"Invalid max_step: {max_step} (must be >= min_step = {min_step})")
        if window < 1:
            raise ValueError(f"Invalid window: {window} (must be >= 1)")
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"Invalid threshold: {threshold} (must be in (0, 1))")
        self.min_step = min_step
        self.max_step = max_step
        self.window = window
        self.threshold = float(threshold)
        self.frozen_at: int | None = None
        self.last_change: float | None = None  # r of the last observation (diagnostic)
        self._levels: deque[float] = deque(maxlen=window + 1)
        self._last_step = 0

    def raise_min_step(self, step: int) -> None:
        """min_step ← max(min_step, step), capped at max_step (for algorithms whose v must also
        grow to its level first, see :func:`settled_step`)."""
        self.min_step = min(self.max_step, max(self.min_step, step))

    def observe(self, step: int, level: float, ready: bool = True) -> bool:
        """Record ℓ after step ``step``; True when the variance is (now or already) frozen.

        ``ready=False`` is the caller's veto (e.g. uncorrected v has not yet grown to its
        level, see :func:`settled_step`): the level is recorded, but only ``max_step`` freezes.
        """
        if self.frozen_at is not None:
            return True
        if step <= self._last_step:
            raise ValueError(
                f"AutoFreeze.observe: step {step} is not after the last observed step "
                f"{self._last_step}; observe each step once, in order"
            )
        self._last_step = step
        if not math.isfinite(level) or level < 0:
            raise ValueError(f"AutoFreeze.observe: level must be finite and >= 0, got {level}")
        self._levels.append(float(level))
        change = math.inf
        if len(self._levels) > self.window and level > 0:
            change = abs(level - self._levels[0]) / level
        self.last_change = change
        if step >= self.max_step:
            reason = f"max_step {self.max_step} reached (relative change {change:.3g})"
        elif ready and step >= self.min_step and change <= self.threshold:
            reason = (
                f"variance level changed by {change:.3g} <= {self.threshold} over the last "
                f"{self.window} observations"
            )
        else:
            return False
        self.frozen_at = step
        logger.info("commopt: variance frozen automatically at step %d: %s", step, reason)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {
            "min_step": self.min_step,
            "max_step": self.max_step,
            "window": self.window,
            "threshold": self.threshold,
            "frozen_at": self.frozen_at,
            "last_step": self._last_step,
            "last_change": self.last_change,
            "levels": list(self._levels),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the settings must match this object's."""
        mine = (self.min_step, self.max_step, self.window, self.threshold)
        saved = (state["min_step"], state["max_step"], state["window"], state["threshold"])
        if mine != saved:
            raise ValueError(
                "AutoFreeze.load_state_dict: saved settings (min_step, max_step, window, "
                f"threshold) = {saved} differ from this object's {mine}"
            )
        self.frozen_at = state["frozen_at"]
        self._last_step = state["last_step"]
        self.last_change = state["last_change"]
        self._levels = deque(state["levels"], maxlen=self.window + 1)

    def __repr__(self) -> str:
        return (
            f"AutoFreeze(min_step={self.min_step}, max_step={self.max_step}, "
            f"window={self.window}, threshold={self.threshold}, frozen_at={self.frozen_at})"
        )


class FreezePoint:
    """One optimizer's last full-precision step: a fixed step, or with ``"auto"`` the step
    :class:`AutoFreeze` chooses.

    The rule's whole state lives in ``schedule`` (the optimizer's ``global_state``, saved and
    restored with it): ``"auto_freeze"`` after every observation, ``"auto_freeze_step"`` once it
    has chosen. So a resumed run decides at the same step. An optimizer whose ``global_state``
    is replaced (a loaded state dict) builds a new FreezePoint over the new one.

    Args:
        value: the config's freeze step (an int) or ``"auto"``.
        schedule: the shared schedule state the decision is kept in.
    """

    def __init__(self, value: int | str, schedule: dict[str, Any]) -> None:
        self.value = value
        self._schedule = schedule
        self._rule: AutoFreeze | None = None

    def last_full_step(self) -> float:
        """The fixed step, or the step the rule chose (``math.inf`` until it has chosen)."""
        if self.value != "auto":
            return self.value
        decided = self._schedule.get("auto_freeze_step")
        return math.inf if decided is None else decided

    @property
    def rule(self) -> AutoFreeze:
        """The automatic freeze rule and its state (restored from the schedule at first use)."""
        if self._rule is None:
            self._rule = AutoFreeze()
            saved = self._schedule.get("auto_freeze")
            if saved is not None:
                self._rule.load_state_dict(saved)
        return self._rule

    def observe(self, step: int, level: float, ready: bool = True) -> bool:
        """Feed the variance level ℓ of step ``step`` to the rule; True once frozen.

        ℓ is computed from v, identical on every rank, so every rank decides alike.
        """
        rule = self.rule
        frozen = rule.observe(step, level, ready)
        self._schedule["auto_freeze"] = rule.state_dict()
        if frozen:
            self._schedule["auto_freeze_step"] = rule.frozen_at
        return frozen
