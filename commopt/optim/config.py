"""Each optimizer's schedule in one typed, validated, checkpointed place.

Per-group hyperparameters (lr, betas, eps, weight_decay, bias_correction) stay in
``param_groups`` as in torch.optim. What decides *when* an optimizer changes phase, and the
coefficients that only make sense for the whole model, live in one frozen dataclass per
optimizer (``optimizer.config``). It is saved in ``state_dict()`` and compared on
``load_state_dict``: resuming with a different schedule would silently move the run into
another phase, so it raises unless ``allow_config_change=True`` is passed.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from typing import Any, TypeVar

from commopt.optim._warnings import warn_at_caller
from commopt.optim.freeze import AutoFreezeSettings, auto_settings

T = TypeVar("T")

__all__ = [
    "DEFAULT_FREEZE_STEP",
    "ConfigAttributes",
    "OnebitAdamConfig",
    "OnebitLambConfig",
    "ZeroOneAdamConfig",
    "check_adam_arguments",
    "check_beta",
    "check_config_change",
    "check_freeze_step",
    "check_nonnegative",
    "check_number",
    "check_step_count",
    "config_differences",
    "document_schedule",
]

#: Written once, placed into each optimizer's docstring at ``{schedule_and_resume}``.
SCHEDULE_AND_RESUME_DOC = """Schedule and resume: the schedule arguments above form
    ``optimizer.config``, a frozen dataclass (read through as ``optimizer.freeze_step`` …,
    never assigned). ``state_dict()`` saves it with the shared schedule state and this rank's
    error buffers (with the rank and world size they belong to); ``load_state_dict`` raises
    ``ValueError`` naming the field and both values if the saved config differs (resuming
    would change the phase), unless called with ``allow_config_change=True``. Error buffers
    from another rank, world size or topology are reset with one warning, never loaded. See
    docs/optimizers.md for parameters without gradients, dtypes and ``add_param_group``."""


def document_schedule(cls: T) -> T:
    """Class decorator: put :data:`SCHEDULE_AND_RESUME_DOC` into the docstring."""
    cls.__doc__ = (cls.__doc__ or "").replace("{schedule_and_resume}", SCHEDULE_AND_RESUME_DOC)
    return cls


_WHY_FREEZE = "the variance has to be estimated before it is frozen"
_WHY_SCALER = "it counts steps between doublings of an interval"
_FEEDBACK = ("classic", "econtrol")
_TRUST_RATIOS = ("frozen", "tracking", "max")


#: A config field that takes ``"auto"`` or an AutoFreezeSettings as well as a fixed step.
_AUTO_FREEZE = {"auto_freeze": True}
_FREEZE_FORMS = "an int >= 1, 'auto' or a commopt.AutoFreezeSettings"


class _DefaultFreezeStep(int):
    """The constructors' default freeze step, 100000, told apart from a user's explicit
    100000 (``is``) so that the default can be announced. Never stored: the config keeps a
    plain int."""

    def __repr__(self) -> str:
        return "100000"


#: ``freeze_step`` / ``var_freeze_step`` when the caller gives none
DEFAULT_FREEZE_STEP = _DefaultFreezeStep(100_000)


def _settle_default_freeze(config: Any, field: str) -> None:
    """In a config's ``__post_init__``: when ``field`` holds :data:`DEFAULT_FREEZE_STEP` (the
    caller gave none), store it as the plain int and warn once per process, on rank 0 as the
    launcher's variables say: 100000 full-precision steps mean no compression in most
    fine-tuning runs (docs/optimizers.md)."""
    if getattr(config, field) is not DEFAULT_FREEZE_STEP:
        return
    object.__setattr__(config, field, 100_000)
    optimizer = type(config).__name__.removesuffix("Config")
    rank = os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    if rank == "0" and (optimizer, field) not in _announced:
        _announced.add((optimizer, field))
        warn_at_caller(
            f"{optimizer}: {field} was not given, so its default of 100000 applies: the first "
            "100000 steps run uncompressed, i.e. no compression at all in most fine-tuning "
            f"runs. Pass {field}=N (the papers freeze after 15-25 % of training) or "
            f"{field}='auto' (the freeze chosen from the variance)"
        )


_announced: set[tuple[str, str]] = set()


def check_freeze_step(name: str, value: int | str | AutoFreezeSettings) -> None:
    """An int >= 1, ``"auto"`` or an :class:`~commopt.optim.freeze.AutoFreezeSettings` (then
    :class:`commopt.optim.freeze.AutoFreeze` decides with those constants)."""
    if auto_settings(value) is not None:
        return
    if isinstance(value, str):
        raise ValueError(f"Invalid {name}: {value!r} (must be {_FREEZE_FORMS})")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Invalid {name}: {value!r} (must be {_FREEZE_FORMS})")
    check_step_count(name, value, 1, _WHY_FREEZE)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"Invalid {name}: {value!r} (choose one of {', '.join(choices)})")


def _check_feedback(config: Any) -> None:
    _check_choice("error_feedback", config.error_feedback, _FEEDBACK)
    if not config.econtrol_eta >= 0.0:  # also rejects NaN
        raise ValueError(f"Invalid econtrol_eta: {config.econtrol_eta} (must be >= 0)")
    guard = config.step_guard
    if not (guard is True or guard is False or (isinstance(guard, str) and guard == "tiny")):
        raise ValueError(f"Invalid step_guard: {guard!r} (choose 'tiny', True or False)")


def check_number(name: str, value: Any) -> None:
    """TypeError unless ``value`` is a real Python (or numpy) number: a tensor hyperparameter
    is torch's device for capturable/fused steps, which read it on the GPU; commopt's kernels
    take Python floats (and would fail deep inside numba, or on a multi-element tensor)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        what = f"a tensor of shape {tuple(value.shape)}" if hasattr(value, "shape") else repr(value)
        raise TypeError(
            f"Invalid {name}: {what} (must be a number: commopt reads hyperparameters as Python "
            "floats, not tensors; pass float(...) of it)"
        )


def check_nonnegative(name: str, value: float) -> None:
    check_number(name, value)
    if not value >= 0.0:  # also rejects NaN
        raise ValueError(f"Invalid {name}: {value} (must be >= 0)")


def check_beta(index: int, value: float) -> None:
    check_number(f"beta parameter at index {index}", value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"Invalid beta parameter at index {index}: {value} (must be in [0, 1))")


def check_adam_arguments(
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> None:
    """The checks every Adam-family constructor makes, with torch.optim's wording."""
    check_nonnegative("learning rate", lr)
    check_nonnegative("epsilon value", eps)
    check_nonnegative("weight_decay value", weight_decay)
    check_beta(0, betas[0])
    check_beta(1, betas[1])


def check_step_count(name: str, value: int, minimum: int, why: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Invalid {name}: {value!r} (must be an int)")
    if value < minimum:
        raise ValueError(f"Invalid {name}: {value} (must be >= {minimum}: {why})")


def _check_range(name: str, low: float, high: float, low_name: str) -> None:
    if not high >= low:
        raise ValueError(
            f"Invalid {name}: {high} (must be >= {low_name} = {low}); "
            f"raise {name} or lower {low_name}"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class OnebitAdamConfig:
    """1-bit Adam's schedule (SPEC §2)."""

    freeze_step: int | str | AutoFreezeSettings = dataclasses.field(
        default=100_000, metadata=_AUTO_FREEZE
    )
    """T_w: the last full-precision (warmup) step; the variance is frozen after it (>= 1), or
    ``"auto"`` / an :class:`~commopt.optim.freeze.AutoFreezeSettings`: decided when the variance has
    settled (:class:`commopt.optim.freeze.AutoFreeze` with those constants)."""
    error_feedback: str = "classic"
    """The compressed exchange's error feedback: ``"classic"`` (SPEC §1) or ``"econtrol"``."""
    econtrol_eta: float = 0.2
    """η of EControl (ignored by ``"classic"``)."""
    step_guard: bool | str = "tiny"
    """Clamp compression-stage steps |m/(√v+ε)| to Adam's bound B(β1, β2): ``"tiny"`` on the
    elements whose v is < 1 % of their tensor's mean v, ``True`` on every element, ``False``
    never (:mod:`commopt.optim.step_guard`)."""

    def __post_init__(self) -> None:
        _settle_default_freeze(self, "freeze_step")
        check_freeze_step("freeze_step", self.freeze_step)
        _check_feedback(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OnebitLambConfig:
    """1-bit LAMB's schedule and trust-ratio coefficients (SPEC §3), one set for the model."""

    freeze_step: int | str | AutoFreezeSettings = dataclasses.field(
        default=100_000, metadata=_AUTO_FREEZE
    )
    """T_w: the last full-precision LAMB step (>= 1), or ``"auto"`` / AutoFreezeSettings."""
    max_coeff: float = 10.0
    """Upper clamp of the warmup trust ratio."""
    min_coeff: float = 0.01
    """Lower clamp of the warmup trust ratio."""
    coeff_beta: float = 0.9
    """β_c: EMA factor of the frozen trust ratio c̄."""
    factor_max: float = 4.0
    """Upper clamp of the variance factor f."""
    factor_min: float = 0.5
    """Lower clamp of the variance factor f."""
    factor_threshold: float = 0.1
    """τ: the most f may change relative to the previous step."""
    trust_ratio: str = "max"
    """``"frozen"``: SPEC §3 (c̄·f); ``"tracking"``: LAMB's clamped ‖p‖/‖u‖ every step;
    ``"max"``: the larger of the two."""
    error_feedback: str = "classic"
    """The compressed exchange's error feedback: ``"classic"`` (SPEC §1) or ``"econtrol"``."""
    econtrol_eta: float = 0.2
    """η of EControl (ignored by ``"classic"``)."""
    step_guard: bool | str = "tiny"
    """Clamp compression-stage |m/(√v+ε)| to Adam's bound B(β1, β2): ``"tiny"``, ``True`` or
    ``False`` as for 1-bit Adam (:mod:`commopt.optim.step_guard`)."""

    def __post_init__(self) -> None:
        _settle_default_freeze(self, "freeze_step")
        check_freeze_step("freeze_step", self.freeze_step)
        _check_choice("trust_ratio", self.trust_ratio, _TRUST_RATIOS)
        _check_feedback(self)
        check_nonnegative("min_coeff", self.min_coeff)
        _check_range("max_coeff", self.min_coeff, self.max_coeff, "min_coeff")
        if not 0.0 <= self.coeff_beta < 1.0:
            raise ValueError(f"Invalid coeff_beta: {self.coeff_beta} (must be in [0, 1))")
        check_nonnegative("factor_min", self.factor_min)
        _check_range("factor_max", self.factor_min, self.factor_max, "factor_min")
        check_nonnegative("factor_threshold", self.factor_threshold)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroOneAdamConfig:
    """0/1 Adam's two schedules (SPEC §4)."""

    var_freeze_step: int | str | AutoFreezeSettings = dataclasses.field(
        default=100_000, metadata=_AUTO_FREEZE
    )
    """T_v: the last step of phase A (>= 1), or ``"auto"`` / AutoFreezeSettings."""
    var_update_scaler: int = 16
    """Variance steps between doublings of the variance interval I_v (>= 1)."""
    local_step_scaler: int = 32768
    """Phase-B steps between doublings of the local-step interval I_l (>= 1)."""
    local_step_clipper: int = 16
    """The largest I_l (>= 1)."""
    error_feedback: str = "classic"
    """The compressed exchange's error feedback: ``"classic"`` (SPEC §1) or ``"econtrol"``."""
    econtrol_eta: float = 0.2
    """η of EControl (ignored by ``"classic"``)."""
    step_guard: bool | str = "tiny"
    """Clamp steps |m/(√v+ε)| to Adam's bound B(β1, β2) in phase A and B: ``"tiny"``, ``True``
    or ``False`` as for 1-bit Adam (:mod:`commopt.optim.step_guard`)."""

    def __post_init__(self) -> None:
        _settle_default_freeze(self, "var_freeze_step")
        check_freeze_step("var_freeze_step", self.var_freeze_step)
        _check_feedback(self)
        check_step_count("var_update_scaler", self.var_update_scaler, 1, _WHY_SCALER)
        check_step_count("local_step_scaler", self.local_step_scaler, 1, _WHY_SCALER)
        check_step_count(
            "local_step_clipper",
            self.local_step_clipper,
            1,
            "it is the largest local-step interval",
        )


def config_differences(saved: dict[str, Any], current: Any) -> list[str]:
    """``field: saved → current`` for every field of ``current`` that ``saved`` sets otherwise.

    A freeze field compares by meaning: ``"auto"``, ``AutoFreezeSettings()`` and the dict that
    ``dataclasses.asdict`` saved for it are the same value when their constants are equal.
    """
    now, changed = dataclasses.asdict(current), []
    for field in dataclasses.fields(current):
        name = field.name
        value = getattr(current, name)
        if name not in saved:
            continue
        if field.metadata.get("auto_freeze"):
            same = _freeze_value(saved[name]) == _freeze_value(value)
        else:
            same = saved[name] == now[name]
        if not same:
            changed.append(f"{name}: saved {saved[name]!r}, now {value!r}")
    return changed


def _freeze_value(value: Any) -> Any:
    """A freeze field's value as it acts: AutoFreezeSettings for the automatic rule (from
    ``"auto"``, itself or its saved dict), else the value itself."""
    if isinstance(value, dict):
        try:
            return AutoFreezeSettings(**value)
        except (TypeError, ValueError):
            return value
    return auto_settings(value) or value


def check_config_change(saved: dict[str, Any], current: Any, owner: str, allow: bool) -> None:
    """Raise (or, with ``allow``, warn) when a checkpoint's config differs from ``current``."""
    changed = config_differences(saved, current)
    if not changed:
        return
    if not allow:
        raise ValueError(
            f"{owner}.load_state_dict: the checkpoint's schedule differs from this optimizer's "
            f"({'; '.join(changed)}); resuming would change the phase. Construct the optimizer "
            "with the saved values, or pass allow_config_change=True to continue under the new "
            "ones"
        )
    warn_at_caller(f"{owner}: resuming under a changed config: {'; '.join(changed)}")


class ConfigAttributes:
    """``opt.freeze_step`` and the other fields of ``opt.config`` read through to it; assigning
    them is refused (the config is frozen: one place, checked on resume)."""

    def __getattr__(self, name: str) -> Any:
        config = self.__dict__.get("config")
        if config is not None and name in {f.name for f in dataclasses.fields(config)}:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        config = self.__dict__.get("config")
        if config is not None and name in {f.name for f in dataclasses.fields(config)}:
            raise AttributeError(
                f"{name} is part of {type(self).__name__}.config (frozen): construct the "
                f"optimizer with {name}=..., or resume with load_state_dict(..., "
                "allow_config_change=True)"
            )
        super().__setattr__(name, value)
