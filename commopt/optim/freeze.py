r"""An automatic freeze point: end the full-precision warmup once the variance has settled.

1-bit Adam and 1-bit LAMB freeze their variance v at ``freeze_step`` (0/1 Adam at
``var_freeze_step``); every later step divides by that frozen v. Freeze too early and v is a poor
preconditioner; freeze too late and the full-precision rounds cost what compression was meant to
save. :class:`AutoFreeze` decides from a scalar summary of v that every rank computes from the
same numbers (during warmup v only ever sees averaged gradients, so it is bit-identical on every
rank). The decision therefore needs no message, and every rank takes it at the same step.

The rule (docs/algorithms/auto_freeze.md says why these constants and what was measured):

    x_t = (1/K) Σ_k ln mean(√v̂_k)    (K parameter tensors: the log of each tensor's level,
                                        averaged, so that every layer counts alike)
    R_t = max x_s − min x_s  over the observations s ∈ [t − ⌊f·t⌋, t]  (the last half, f = 1/2)
    freeze at the first step t ≥ min_step with R_t ≤ threshold, and at the latest at max_step.

The window grows with the elapsed steps, so the test is the same at step 100 and 10⁵ (a level
that moved by at most τ over the last t/2 steps would, at that rate, move by at most 2τ over
the next t), and a level that rose and fell inside the window (a maximum) counts with its whole
excursion, not with the difference of its ends.

v̂ is the bias-corrected variance. An algorithm that uses v without bias correction (0/1 Adam)
must also wait until v has grown to its level; :func:`settled_step` gives the step from which
√(1 − β2^t) ≥ 1 − threshold, and such an algorithm vetoes earlier decisions.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import deque
from typing import Any

__all__ = [
    "AutoFreeze",
    "AutoFreezeSettings",
    "FreezePoint",
    "VarianceLevel",
    "auto_settings",
    "settled_step",
    "variance_level",
]

logger = logging.getLogger(__name__)

#: ``AutoFreeze.state_dict()["rule"]``: the layout of the rule's saved state. States without it
#: were written by the first rule (Σ_k mean √v̂_k over a fixed window of 20 observations).
RULE = "log-range/half"


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


@dataclasses.dataclass(frozen=True)
class VarianceLevel:
    """Σ_k ln mean(√v̂_k) over ``tensors`` parameter tensors; levels of several buckets add up.

    An optimizer sums :func:`variance_level` over its buckets (``level += variance_level(…)``,
    starting from ``0.0``) and hands the total to :meth:`AutoFreeze.observe`, which uses the
    mean :attr:`log_mean`. Tensors whose v is still all zero are not counted.
    """

    log_sum: float = 0.0
    tensors: int = 0

    @property
    def log_mean(self) -> float:
        """x = (1/K) Σ_k ln mean(√v̂_k) (``-inf`` when no tensor has a variance yet)."""
        return self.log_sum / self.tensors if self.tensors else -math.inf

    def __add__(self, other: object) -> VarianceLevel:
        if isinstance(other, VarianceLevel):
            return VarianceLevel(self.log_sum + other.log_sum, self.tensors + other.tensors)
        if isinstance(other, (int, float)) and other == 0:  # sum()'s and ``level = 0.0``'s start
            return self
        return NotImplemented

    __radd__ = __add__


def variance_level(variances: list[Any], bias_correction: float = 1.0) -> VarianceLevel:
    """Σ_k ln mean(√(v_k / bias_correction)) over the given tensors, in float64, and their count.

    Every rank holds the same v and sums in the same order, so every rank gets the same level.
    Empty tensors and tensors whose v is all zero are skipped.
    """
    total, count = 0.0, 0
    for v in variances:
        if v.numel():
            level = float(v.double().div(bias_correction).sqrt_().mean())
            if level > 0:
                total += math.log(level)
                count += 1
    return VarianceLevel(total, count)


@dataclasses.dataclass(frozen=True)
class AutoFreezeSettings:
    """The constants of :class:`AutoFreeze`; pass one as ``freeze_step`` (``var_freeze_step``)
    to choose them. ``"auto"`` means ``AutoFreezeSettings()``.

    Args:
        min_step: never freeze before this step (default 40: the window then holds at least
            20 observations; over fewer, a range says little).
        max_step: freeze at this step at the latest, whatever the level does (default 100000,
            the fixed ``freeze_step`` default of SPEC §2).
        fraction: f, the window is the observations of the last ⌊f·t⌋ steps (default 1/2).
        threshold: τ, the largest range R_t = max − min of the log-level x over the window
            that counts as settled (default 0.05).
    """

    min_step: int = 40
    max_step: int = 100_000
    fraction: float = 0.5
    threshold: float = 0.05

    def __post_init__(self) -> None:
        for name in ("min_step", "max_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Invalid {name}: {value!r} (must be an int)")
        if self.min_step < 1:
            raise ValueError(f"Invalid min_step: {self.min_step} (must be >= 1)")
        if self.max_step < self.min_step:
            raise ValueError(
                f"Invalid max_step: {self.max_step} (must be >= min_step = {self.min_step})"
            )
        for name in ("fraction", "threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"Invalid {name}: {value!r} (must be a float)")
            if not 0.0 < value < 1.0:
                raise ValueError(f"Invalid {name}: {value} (must be in (0, 1))")
            object.__setattr__(self, name, float(value))  # saved and compared as floats


def auto_settings(value: object) -> AutoFreezeSettings | None:
    """The automatic freeze's settings for a ``freeze_step`` value: ``"auto"`` → the defaults,
    an :class:`AutoFreezeSettings` → itself, anything else (a fixed step) → None."""
    if isinstance(value, AutoFreezeSettings):
        return value
    if isinstance(value, str) and value == "auto":
        return AutoFreezeSettings()
    return None


class AutoFreeze:
    r"""Decides the freeze step from the variance level observed after each warmup step.

    Args: ``min_step``, ``max_step``, ``fraction``, ``threshold``, as in
    :class:`AutoFreezeSettings` (validated there; :attr:`settings` holds them).

    Use: call :meth:`observe` once per step that updated v (in order) with that step's
    :class:`VarianceLevel` (a float ℓ > 0 is taken as one tensor of level ℓ); it returns True
    from the step at which it froze on. :attr:`frozen_at` is that step (``None`` before),
    :attr:`last_change` the last R_t. The state (the window's running maximum and minimum,
    the decision) is saved by :meth:`state_dict` and restored by :meth:`load_state_dict`, so a
    resumed run decides exactly as an uninterrupted one.
    """

    def __init__(
        self,
        min_step: int = 40,
        max_step: int = 100_000,
        fraction: float = 0.5,
        threshold: float = 0.05,
    ) -> None:
        self._settings = AutoFreezeSettings(min_step, max_step, fraction, threshold)
        self.frozen_at: int | None = None
        self.last_change: float | None = None  # R of the last observation (diagnostic)
        self._first_step: int | None = None  # the first observation with a level
        self._last_step = 0
        # monotone queues of (step, x): _highs decreasing, _lows increasing; their heads are the
        # window's maximum and minimum (each observation enters and leaves each queue once)
        self._highs: deque[tuple[int, float]] = deque()
        self._lows: deque[tuple[int, float]] = deque()

    @classmethod
    def from_settings(cls, settings: AutoFreezeSettings) -> AutoFreeze:
        """A rule with these (already validated) settings."""
        return cls(**dataclasses.asdict(settings))

    @property
    def settings(self) -> AutoFreezeSettings:
        """min_step, max_step, fraction and threshold as one frozen value."""
        return self._settings

    min_step = property(lambda self: self._settings.min_step, doc="Never freeze before.")
    max_step = property(lambda self: self._settings.max_step, doc="Freeze here at the latest.")
    fraction = property(lambda self: self._settings.fraction, doc="f: the window's fraction.")
    threshold = property(lambda self: self._settings.threshold, doc="τ: the settled range.")

    def raise_min_step(self, step: int) -> None:
        """min_step ← max(min_step, step), capped at max_step (for algorithms whose v must also
        grow to its level first, see :func:`settled_step`)."""
        min_step = min(self.max_step, max(self.min_step, step))
        self._settings = dataclasses.replace(self._settings, min_step=min_step)

    def window_start(self, step: int) -> int:
        """The first step of the window at step t: t − ⌊f·t⌋."""
        return step - math.floor(self.fraction * step)

    def observe(self, step: int, level: VarianceLevel | float, ready: bool = True) -> bool:
        """Record the level after step ``step``; True when the variance is (now or already)
        frozen.

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
        if not isinstance(level, VarianceLevel):
            if isinstance(level, bool) or not isinstance(level, (int, float)):
                raise TypeError(f"AutoFreeze.observe: level must be a VarianceLevel, got {level!r}")
            if not math.isfinite(level) or level < 0:
                raise ValueError(f"AutoFreeze.observe: level must be finite and >= 0, got {level}")
            level = VarianceLevel(math.log(level), 1) if level > 0 else VarianceLevel()
        x = level.log_mean
        if math.isnan(x) or x == math.inf:
            raise ValueError(f"AutoFreeze.observe: level must be finite, got {level}")
        self._last_step = step
        if level.tensors:
            if self._first_step is None:
                self._first_step = step
            while self._highs and self._highs[-1][1] <= x:
                self._highs.pop()
            self._highs.append((step, x))
            while self._lows and self._lows[-1][1] >= x:
                self._lows.pop()
            self._lows.append((step, x))
        start = self.window_start(step)
        for queue in (self._highs, self._lows):
            while queue and queue[0][0] < start:
                queue.popleft()
        change = math.inf  # until levels cover the whole window
        if self._first_step is not None and self._first_step <= start and self._highs:
            change = self._highs[0][1] - self._lows[0][1]
        self.last_change = change
        if step >= self.max_step:
            reason = f"max_step {self.max_step} reached (log-level range {change:.3g})"
        elif ready and step >= self.min_step and change <= self.threshold:
            reason = (
                f"the log of the variance level moved within {change:.3g} <= {self.threshold} "
                f"over steps {start}..{step}"
            )
        else:
            return False
        self.frozen_at = step
        logger.info("commopt: variance frozen automatically at step %d: %s", step, reason)
        return True

    def state_dict(self) -> dict[str, Any]:
        """The rule's constants and what it has observed."""
        return {
            "rule": RULE,
            "min_step": self.min_step,
            "max_step": self.max_step,
            "fraction": self.fraction,
            "threshold": self.threshold,
            "frozen_at": self.frozen_at,
            "first_step": self._first_step,
            "last_step": self._last_step,
            "last_change": self.last_change,
            "highs": [list(e) for e in self._highs],
            "lows": [list(e) for e in self._lows],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, continuing under this object's settings.

        A decided state keeps its decision whatever the settings. An undecided one continues
        its observations under this object's min_step, max_step and threshold (they judge the
        same history); its window was trimmed for the saved fraction, so a larger fraction is
        refused (a smaller one needs only what was kept). A state of the first rule (no
        ``"rule"`` key: a window of levels Σ_k mean √v̂_k) loads when it has decided;
        undecided, it cannot continue under this rule and is refused.
        """
        undecided = state.get("frozen_at") is None
        how = (
            "fix the freeze step: construct the optimizer with an int freeze_step "
            "(var_freeze_step for ZeroOneAdam) and load with allow_config_change=True"
        )
        if "rule" not in state:
            if undecided:
                raise ValueError(
                    "AutoFreeze.load_state_dict: this state was saved by the previous automatic "
                    f"freeze rule before it decided (last observed step {state.get('last_step')}"
                    "), and the current rule cannot continue its history. Resume with the "
                    f"commopt version that saved it, or {how}."
                )
            self.frozen_at = state["frozen_at"]
            self._last_step = state["last_step"]
            self.last_change = state.get("last_change")
            return
        if state["rule"] != RULE:
            raise ValueError(
                f"AutoFreeze.load_state_dict: unknown rule {state['rule']!r} (this version "
                f"has {RULE!r})"
            )
        if undecided and self.fraction > state["fraction"]:
            raise ValueError(
                "AutoFreeze.load_state_dict: the saved undecided state kept only the window of "
                f"fraction {state['fraction']} (the last ⌊f·t⌋ steps), and fraction "
                f"{self.fraction} needs older observations, which were discarded. Resume with "
                f"fraction <= {state['fraction']} (e.g. AutoFreezeSettings(fraction="
                f"{state['fraction']})), or {how}."
            )
        self.frozen_at = state["frozen_at"]
        self._first_step = state["first_step"]
        self._last_step = state["last_step"]
        self.last_change = state["last_change"]
        self._highs = deque((int(s), float(x)) for s, x in state["highs"])
        self._lows = deque((int(s), float(x)) for s, x in state["lows"])

    def __repr__(self) -> str:
        return (
            f"AutoFreeze(min_step={self.min_step}, max_step={self.max_step}, "
            f"fraction={self.fraction}, threshold={self.threshold}, frozen_at={self.frozen_at})"
        )


class FreezePoint:
    """One optimizer's last full-precision step: a fixed step, or with ``"auto"`` (an
    :class:`AutoFreezeSettings`) the step :class:`AutoFreeze` chooses.

    The rule's whole state lives in ``schedule`` (the optimizer's ``global_state``, saved and
    restored with it): ``"auto_freeze"`` after every observation, ``"auto_freeze_step"`` once it
    has chosen. So a resumed run decides at the same step. An optimizer whose ``global_state``
    is replaced (a loaded state dict) builds a new FreezePoint over the new one: an undecided
    saved state continues under this FreezePoint's settings, or is refused there, at load, when
    the rule cannot continue it (:meth:`AutoFreeze.load_state_dict`).

    Args:
        value: the config's freeze step: an int, ``"auto"`` or an :class:`AutoFreezeSettings`.
        schedule: the shared schedule state the decision is kept in.
    """

    def __init__(self, value: int | str | AutoFreezeSettings, schedule: dict[str, Any]) -> None:
        self.value = value
        #: the automatic rule's constants (None: a fixed step)
        self.settings = auto_settings(value)
        self._schedule = schedule
        self._rule: AutoFreeze | None = None
        if self.settings is not None and schedule.get("auto_freeze_step") is None:
            _ = self.rule  # restore (and check) a saved undecided state now, not at a later step

    def last_full_step(self) -> float:
        """The fixed step, or the step the rule chose (``math.inf`` until it has chosen)."""
        if self.settings is None:
            return self.value
        decided = self._schedule.get("auto_freeze_step")
        return math.inf if decided is None else decided

    @property
    def rule(self) -> AutoFreeze:
        """The automatic freeze rule and its state (restored from the schedule at first use)."""
        if self._rule is None:
            self._rule = AutoFreeze.from_settings(self.settings or AutoFreezeSettings())
            saved = self._schedule.get("auto_freeze")
            if saved is not None:
                self._rule.load_state_dict(saved)
        return self._rule

    def observe(self, step: int, level: VarianceLevel | float, ready: bool = True) -> bool:
        """Feed the variance level of step ``step`` to the rule; True once frozen.

        The level is computed from v, identical on every rank, so every rank decides alike.
        """
        rule = self.rule
        frozen = rule.observe(step, level, ready)
        self._schedule["auto_freeze"] = rule.state_dict()
        if frozen:
            self._schedule["auto_freeze_step"] = rule.frozen_at
        return frozen
