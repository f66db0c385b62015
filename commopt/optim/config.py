"""What an optimizer is built with: its schedule and communication options in one typed,
validated, checkpointed place, and what the constructors and ``add_param_group`` refuse.

Per-group hyperparameters (lr, betas, eps, weight_decay, bias_correction) stay in
``param_groups`` as in torch.optim. What decides *when* an optimizer changes phase, and the
coefficients that only make sense for the whole model, live in one frozen dataclass per
optimizer (``optimizer.config``). It is saved in ``state_dict()`` and compared on
``load_state_dict``: resuming with a different schedule would silently move the run into
another phase, so it raises unless ``allow_config_change=True`` is passed.

**Refusals**, beyond the config's own checks: keywords that are no option, param groups the flat
fp32 state cannot represent, GradScaler after early work, and 0/1 Adam's groups that would join
after its variance froze.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import textwrap
from collections.abc import Callable
from typing import Any, TypedDict, TypeVar

import torch

from commopt.choices import (
    ERROR_FEEDBACKS,
    STEP_GUARDS,
    TOPOLOGIES,
    TRUST_RATIOS,
    ErrorFeedback,
    StepGuard,
    Topology,
    TrustRatio,
    check_choice,
)
from commopt.notices import warn_at_caller
from commopt.optim.adam import refuse_complex_and_float64
from commopt.optim.freeze import AutoFreezeSettings, auto_settings

__all__ = [
    "COMM_OPTIONS_DOC",
    "DEFAULT_FREEZE_STEP",
    "CommKeywords",
    "CommOptions",
    "OnebitAdamConfig",
    "OnebitLambConfig",
    "ZeroOneAdamConfig",
    "check_adam_arguments",
    "check_beta",
    "check_config_change",
    "check_freeze_step",
    "check_group_joins_phase_a",
    "check_no_scaler_after_early_work",
    "check_nonnegative",
    "check_number",
    "check_param_group",
    "check_step_count",
    "comm_keywords",
    "config_differences",
    "configured_by",
    "fill_template",
    "read_through_fields",
    "saved_config",
]


T = TypeVar("T")


def _tail_dedented(text: str) -> str:
    """``text`` with the common indentation of its lines after the first removed (a template
    written where it is read, filled in where it is used: :func:`fill_template`)."""
    first, _, rest = text.partition("\n")
    return f"{first}\n{textwrap.dedent(rest)}" if rest else first


def fill_template(doc: str, placeholder: str, text: str) -> str:
    """``doc`` with the line that holds ``placeholder`` replaced by ``text``, each of its lines
    indented like that line (for ``help()`` here, and for the API reference, whose docstrings
    are dedented: docs/griffe_commopt.py)."""
    lines = []
    for line in doc.splitlines():
        if line.strip() == placeholder:
            indent = line[: len(line) - len(line.lstrip())]
            lines.extend(indent + t if t else t for t in text.splitlines())
        else:
            lines.append(line)
    return "\n".join(lines) + ("\n" if doc.endswith("\n") else "")


#: Written once, placed into each optimizer's docstring at ``{schedule_and_resume}``.
SCHEDULE_AND_RESUME_DOC = """Schedule and resume: the schedule arguments above and the
    communication options form ``optimizer.config``, a frozen dataclass (read through as
    ``optimizer.freeze_step`` …, never assigned). ``state_dict()`` saves it with the shared
    schedule state and this rank's error buffers (with the rank and world size they belong to);
    ``load_state_dict`` raises ``ValueError`` naming the field and both values if the saved
    config differs (resuming would change the phase), unless called with
    ``allow_config_change=True``. Error buffers from another rank, world size or topology are
    reset with one warning, never loaded. See docs/optimizers.md for parameters without
    gradients, dtypes and ``add_param_group``."""
SCHEDULE_AND_RESUME_DOC = _tail_dedented(SCHEDULE_AND_RESUME_DOC)

#: The keyword-only communication options (:class:`CommOptions`), written once and placed into
#: each optimizer's Args at ``{communication_options}``, the way torch writes ``_foreach_doc``.
COMM_OPTIONS_DOC = """topology: ``"flat"`` (SPEC §1 over all ranks, default), ``"hierarchical"``
            (full precision inside each node, 1 bit between nodes; on gloo the node's ranks
            share memory, ``COMMOPT_SHARED_MEMORY=0`` to use TCP; docs/hierarchical.md) or
            ``"auto"`` (hierarchical when there are several nodes of several ranks and a fast
            path inside the node).
        overlap: start each bucket's communication during backward, as soon as its last
            gradient is accumulated, on staged buffers; ``step()`` waits for it and commits.
            Bit-identical to ``overlap=False`` (default False). Requires every rank to produce
            gradients for the same parameters in the same order each step; accumulate with
            ``no_sync()``; ``p.grad`` stays local, so clipping it after backward has no effect,
            and GradScaler is refused. Under DDP use :mod:`commopt.ddp` instead. The exchanges
            run on a communication thread, bucket by bucket in the order their gradients
            become ready; what each optimizer starts early: docs/overlap.md.
        bucket_numel: the most elements one flat bucket holds (default 2**25; 1-bit LAMB: one
            bucket per device and dtype, one compressed call per step; a larger tensor gets a
            bucket of its own). One bucket is one compressed exchange: with ``overlap=True``,
            several buckets let the first exchanges run while backward is still computing the
            rest. Results depend on the layout (one scale per bucket), so compare runs at the
            same ``bucket_numel``.
        error_feedback: ``"classic"`` (SPEC §1, default) or ``"econtrol"`` (EControl, Gao et
            al. 2024; flat topology; docs/algorithms/error_feedback.md): it helped on strongly
            heterogeneous data and was 14–30 % worse (or diverged) on the demo LM, where every
            rank sees the same data mix (docs/experiments.md §3).
        econtrol_eta: η of EControl (default 0.2; ignored by ``"classic"``).
        step_guard: clamp steps |m̂/(√v̂ + ε)| taken against a frozen variance to B(β1, β2),
            the largest step exact Adam can take (:mod:`commopt.optim.adam`): ``"tiny"``
            (default) on the elements whose v is below 1 % of their tensor's mean v, ``True``
            on every element, ``False`` never (the paper's step)."""
COMM_OPTIONS_DOC = _tail_dedented(COMM_OPTIONS_DOC)


def configured_by(config_type: type) -> Callable[[T], T]:
    """Class decorator for an optimizer whose ``config`` is a ``config_type``: its docstring
    gets :data:`SCHEDULE_AND_RESUME_DOC` and :data:`COMM_OPTIONS_DOC` at their placeholders, and
    the class a read-only property per config field (``opt.freeze_step`` reads
    ``opt.config.freeze_step``; assigning it raises, naming the two ways to change it)."""

    def decorate(cls: T) -> T:
        doc = fill_template(cls.__doc__ or "", "{schedule_and_resume}", SCHEDULE_AND_RESUME_DOC)
        cls.__doc__ = fill_template(doc, "{communication_options}", COMM_OPTIONS_DOC)
        return read_through_fields(cls, config_type, _REMEDY)

    return decorate


def read_through_fields(cls: T, config_type: type, remedy: str) -> T:
    """A read-only property ``self.config.<field>`` per field ``cls`` does not define; setting
    one raises an ``AttributeError`` naming the frozen config and ``remedy`` (with ``{name}``)."""
    for field in dataclasses.fields(config_type):
        if not any(field.name in vars(k) for k in cls.__mro__):  # (the class's own wins)
            setattr(cls, field.name, _read_through(field.name, remedy))
    return cls


def _read_through(name: str, remedy: str) -> property:
    def read(self: Any) -> Any:
        return getattr(self.config, name)

    def refuse(self: Any, value: Any) -> None:
        why = remedy.format(name=name)
        raise AttributeError(f"{name} is part of {type(self).__name__}.config (frozen): {why}")

    return property(read, refuse, doc=f"``config.{name}`` (read-only).")


_REMEDY = (
    "construct the optimizer with {name}=..., or resume with "
    "load_state_dict(..., allow_config_change=True)"
)
_WHY_FREEZE = "the variance has to be estimated before it is frozen"
_WHY_SCALER = "it counts steps between doublings of an interval"
#: a config field that is not saved in ``state_dict()`` nor compared on resume: the layout and
#: the wiring, whose change a resume handles itself (error buffers for another topology or
#: bucket size are reset or refused, overlap is bit-identical)
_NOT_SAVED = {"saved": False}


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
    """TypeError unless a number, ValueError unless ≥ 0 (NaN included)."""
    check_number(name, value)
    if not value >= 0.0:  # also rejects NaN
        raise ValueError(f"Invalid {name}: {value} (must be >= 0)")


def check_beta(index: int, value: float) -> None:
    """A β in [0, 1), worded as torch.optim words it."""
    check_number(f"beta parameter at index {index}", value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"Invalid beta parameter at index {index}: {value} (must be in [0, 1))")


def check_tensor_hyperparameters(lr: Any, betas: Any, where: str = "") -> None:
    """ValueError for a tensor ``lr`` or ``betas``, in the words torch.optim.Adam refuses them
    for ``capturable=False, foreach=True``: commopt's steps are of that kind (flat kernels that
    read Python floats), so code written for torch sees the error it expects."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element{where}")
        raise ValueError(
            f"lr as a Tensor is not supported for capturable=False and foreach=True{where}, "
            "which is how commopt's optimizers step (their kernels read Python floats): "
            "pass float(lr)"
        )
    tensors = [isinstance(beta, torch.Tensor) for beta in betas]
    if any(tensors):
        if not all(tensors):
            raise ValueError(f"betas must be either both floats or both Tensors{where}")
        raise ValueError(
            f"betas[0] as a Tensor is not supported for capturable=False and foreach=True{where}, "
            "which is how commopt's optimizers step: pass floats"
        )


def check_adam_arguments(
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> None:
    """The checks every Adam-family constructor makes, with torch.optim's wording."""
    check_tensor_hyperparameters(lr, betas)
    check_nonnegative("learning rate", lr)
    check_nonnegative("epsilon value", eps)
    check_nonnegative("weight_decay value", weight_decay)
    check_beta(0, betas[0])
    check_beta(1, betas[1])


def check_step_count(name: str, value: int, minimum: int, why: str) -> None:
    """An int ≥ ``minimum`` (``why``: the reason, in the message)."""
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
class CommOptions:
    """The communication options every commopt optimizer takes, keyword-only, validated once
    here (:data:`COMM_OPTIONS_DOC` documents them in each constructor). Each optimizer's config
    extends it with its schedule; ``topology``, ``overlap`` and ``bucket_numel`` are not saved
    (a resume handles their change itself), the rest are and are checked on resume."""

    topology: Topology = dataclasses.field(default="flat", metadata=_NOT_SAVED)
    """``"flat"``, ``"hierarchical"`` or ``"auto"`` (:data:`commopt.choices.Topology`)."""
    overlap: bool = dataclasses.field(default=False, metadata=_NOT_SAVED)
    """Start each bucket's communication during backward (docs/overlap.md)."""
    bucket_numel: int | None = dataclasses.field(default=None, metadata=_NOT_SAVED)
    """The most elements one flat bucket holds (None: the optimizer's default)."""
    error_feedback: ErrorFeedback = "classic"
    """The compressed exchange's error feedback: ``"classic"`` (SPEC §1) or ``"econtrol"``."""
    econtrol_eta: float = 0.2
    """η of EControl (ignored by ``"classic"``)."""
    step_guard: StepGuard = "tiny"
    """Clamp steps |m/(√v+ε)| against a frozen variance to Adam's bound B(β1, β2): ``"tiny"``
    on the elements whose v is < 1 % of their tensor's mean v, ``True`` on every element,
    ``False`` never (:mod:`commopt.optim.adam`)."""

    def __post_init__(self) -> None:
        check_choice("topology", self.topology, TOPOLOGIES)
        if not isinstance(self.overlap, bool):
            raise TypeError(f"overlap must be True or False, got {self.overlap!r}")
        numel = self.bucket_numel
        if numel is not None and (isinstance(numel, bool) or not isinstance(numel, int)):
            raise TypeError(f"bucket_numel must be an int, got {type(numel).__name__}")
        if numel is not None and numel < 1:
            raise ValueError(f"Invalid bucket_numel: {numel} (must be >= 1)")
        check_choice("error_feedback", self.error_feedback, ERROR_FEEDBACKS)
        check_number("econtrol_eta", self.econtrol_eta)
        if not self.econtrol_eta >= 0.0:  # also rejects NaN
            raise ValueError(f"Invalid econtrol_eta: {self.econtrol_eta} (must be >= 0)")
        check_choice("step_guard", self.step_guard, STEP_GUARDS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OnebitAdamConfig(CommOptions):
    """1-bit Adam's schedule (SPEC §2) and communication options."""

    freeze_step: int | str | AutoFreezeSettings = dataclasses.field(
        default=100_000, metadata=_AUTO_FREEZE
    )
    """T_w: the last full-precision (warmup) step; the variance is frozen after it (>= 1), or
    ``"auto"`` / an :class:`~commopt.optim.freeze.AutoFreezeSettings`: decided when the variance has
    settled (:class:`commopt.optim.freeze.AutoFreeze` with those constants)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _settle_default_freeze(self, "freeze_step")
        check_freeze_step("freeze_step", self.freeze_step)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OnebitLambConfig(CommOptions):
    """1-bit LAMB's schedule and trust-ratio coefficients (SPEC §3), one set for the model, and
    communication options."""

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
    trust_ratio: TrustRatio = "max"
    """``"frozen"``: SPEC §3 (c̄·f); ``"tracking"``: LAMB's clamped ‖p‖/‖u‖ every step;
    ``"max"``: the larger of the two."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _settle_default_freeze(self, "freeze_step")
        check_freeze_step("freeze_step", self.freeze_step)
        check_choice("trust_ratio", self.trust_ratio, TRUST_RATIOS)
        check_nonnegative("min_coeff", self.min_coeff)
        _check_range("max_coeff", self.min_coeff, self.max_coeff, "min_coeff")
        if not 0.0 <= self.coeff_beta < 1.0:
            raise ValueError(f"Invalid coeff_beta: {self.coeff_beta} (must be in [0, 1))")
        check_nonnegative("factor_min", self.factor_min)
        _check_range("factor_max", self.factor_min, self.factor_max, "factor_min")
        check_nonnegative("factor_threshold", self.factor_threshold)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroOneAdamConfig(CommOptions):
    """0/1 Adam's two schedules (SPEC §4) and communication options."""

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

    def __post_init__(self) -> None:
        super().__post_init__()
        _settle_default_freeze(self, "var_freeze_step")
        check_freeze_step("var_freeze_step", self.var_freeze_step)
        check_step_count("var_update_scaler", self.var_update_scaler, 1, _WHY_SCALER)
        check_step_count("local_step_scaler", self.local_step_scaler, 1, _WHY_SCALER)
        check_step_count(
            "local_step_clipper",
            self.local_step_clipper,
            1,
            "it is the largest local-step interval",
        )


class CommKeywords(TypedDict, total=False):
    """The constructors' ``**comm``: :class:`CommOptions`' fields as keywords (documented there
    and in each constructor's Args; a test keeps the two lists equal)."""

    topology: Topology
    overlap: bool
    bucket_numel: int | None
    error_feedback: ErrorFeedback
    econtrol_eta: float
    step_guard: StepGuard


def comm_keywords(owner: str, keywords: dict[str, Any]) -> dict[str, Any]:
    """The communication options among a constructor's ``**comm`` keywords; torch.optim.Adam's
    flags as a drop-in takes them: ``foreach`` with any value (commopt has one implementation),
    the others (:data:`_TORCH_ONLY`) unset or False, else ``ValueError``. Other keywords:
    ``TypeError`` naming ``owner``."""
    _refuse_torch_only(keywords, owner)
    comm = {k: v for k, v in keywords.items() if k not in ("foreach", *_TORCH_ONLY)}
    known = {f.name for f in dataclasses.fields(CommOptions)}
    unknown = sorted(set(comm) - known)
    if unknown:
        raise TypeError(
            f"{owner}() got an unexpected keyword argument {unknown[0]!r} (the keyword-only "
            f"options are {', '.join(sorted(known))})"
        )
    return comm


def saved_config(config: CommOptions) -> dict[str, Any]:
    """The fields of ``config`` that ``state_dict()`` saves and a resume compares."""
    saved = dataclasses.asdict(config)
    for field in dataclasses.fields(config):
        if field.metadata.get("saved", True) is False:
            del saved[field.name]
    return saved


def config_differences(saved: dict[str, Any], current: Any) -> list[str]:
    """``field: saved → current`` for every field of ``current`` that ``saved`` sets otherwise.

    A freeze field compares by meaning: ``"auto"``, ``AutoFreezeSettings()`` and the dict that
    ``dataclasses.asdict`` saved for it are the same value when their constants are equal.
    """
    now, changed = dataclasses.asdict(current), []
    for field in dataclasses.fields(current):
        name = field.name
        value = getattr(current, name)
        if name not in saved or field.metadata.get("saved", True) is False:
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


#: torch.optim.Adam's options that commopt's optimizers do not have, and why
_TORCH_ONLY = {
    "maximize": "negate the loss instead",
    "amsgrad": "the frozen variance is what 1-bit and 0/1 Adam compress against",
    "capturable": "no CUDA-graph capture of a step that communicates",
    "differentiable": "no autograd through the step",
    "fused": "commopt's own flat kernels run the step",
}


def _refuse_torch_only(opts: dict[str, Any], owner: str, where: str = "", hint: str = "") -> None:
    """ValueError naming the first :data:`_TORCH_ONLY` option set in ``opts``, and why."""
    for key, why in _TORCH_ONLY.items():
        if opts.get(key):
            raise ValueError(f"{key}={opts[key]!r}{where}: {owner} has no {key} ({why}){hint}")


def check_param_group(
    group: dict[str, Any], name: str, config: Any, defaults: dict[str, Any]
) -> None:
    """Refuse what the flat fp32 state cannot represent, naming the way out."""
    for key in dataclasses.asdict(config):
        if key in group and key not in defaults:
            raise ValueError(
                f"{key} is one setting for the whole {name} (its config), "
                f"not per param group; pass {key}= to the constructor"
            )
    check_tensor_hyperparameters(group.get("lr"), group.get("betas", ()), " in a param group")
    for key in ("lr", "eps", "weight_decay"):
        if key in group:
            check_number(f"{key} in a param group", group[key])
    for i, beta in enumerate(group.get("betas", ())):
        check_number(f"betas[{i}] in a param group", beta)
    _refuse_torch_only(
        group, name, " in a param group", "; remove it (the constructor refuses it too)"
    )
    refuse_complex_and_float64(name, group["params"])
    for p in group["params"]:
        if p.device.type == "meta":
            raise ValueError(
                f"{name} got a parameter on the meta device (shape "
                f"{tuple(p.shape)}): materialise the model (e.g. model.to_empty(device=...) "
                "and load its weights) before creating the optimizer"
            )
    mask = group.get("exp_avg_mask")
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"exp_avg_mask must be a tensor, got {type(mask).__name__}")
    for p in group["params"]:
        try:
            torch.broadcast_shapes(mask.shape, p.shape)
        except RuntimeError:
            raise ValueError(
                f"exp_avg_mask of shape {tuple(mask.shape)} does not broadcast to a parameter "
                f"of shape {tuple(p.shape)} in its group"
            ) from None


def check_group_joins_phase_a(step: int, frozen: float | None) -> None:
    """0/1 Adam: parameters may join in phase A only (``frozen``: T_v, None while the
    constructor adds its groups): after it v is frozen, and new parameters would never get one."""
    if frozen is not None and step > frozen:
        raise ValueError(
            f"ZeroOneAdam cannot add a param group at step {step}, after var_freeze_step = "
            f"{frozen}: the variance is frozen and new parameters would "
            "never get one. Add the group before the freeze, or give its parameters an "
            "optimizer of their own"
        )


def check_no_scaler_after_early_work(name: str, started_early: bool) -> None:
    """A GradScaler's scale with early work (the DDP hook, ``overlap=True``) that already used
    the gradients during backward, before the scaler could unscale them: refused."""
    if started_early:
        raise RuntimeError(
            f"{name}: a DDP hook or overlap=True used the gradients during backward, before "
            "GradScaler could unscale them; with the commopt DDP hook or overlap, use bf16 "
            "autocast (no GradScaler) or a static loss scale folded into lr"
        )
