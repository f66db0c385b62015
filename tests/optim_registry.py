"""One registry of commopt's optimizers for the generic tests (in the spirit of torch's
``OptimizerInfo`` and optax's parametrised optimizer tests).

Each ``OptimizerInfo`` names an optimizer's class, a small test configuration (a schedule short
enough that a dozen steps visit every phase), the phases of that schedule written from
SPEC §2–§4 independently of the optimizer's code, and its table of invalid arguments with the
expected error type and message. The generic tests (``tests/unit/test_optimizers_common.py``,
``tests/multirank/common_bodies.py``) iterate over ``OPTIMIZERS`` and over each one's phases, so
"in every phase" means the same thing for all three.

Only the public API is used here and in the tests built on it: constructors, ``step``,
``param_groups``, ``state[p]``, ``state_dict``/``load_state_dict``, ``global_state``. The
optimizers' internals are being rewritten; these tests are the safety net for that.

A new optimizer gets its ``OptimizerInfo`` here and every generic test covers it
(``test_registry_covers_every_public_optimizer`` fails until it is listed). A new generic check
is a test over ``OPTIMIZERS`` (one process) or a ``body_*``/``check_*`` pair in
``common_bodies.py`` (multi-rank), not a copy per optimizer.

Also here: the tiny model, data and comparison helpers both the unit and the multi-rank tests
use. The helpers return differences instead of asserting, so multi-rank bodies can run every
collective before anyone asserts (a rank that fails alone would leave the others hanging).
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

import commopt

__all__ = [
    "BY_NAME",
    "DEVICES",
    "MODES",
    "OPTIMIZERS",
    "ErrorCase",
    "OptimizerInfo",
    "Phase",
    "batch",
    "devices",
    "flat_params",
    "make_groups",
    "make_model",
    "outside",
    "reload",
    "snapshot",
    "snapshot_diff",
    "state_dict_diff",
    "train_step",
]

#: How an optimizer runs, and the constructor options each mode adds (:meth:`OptimizerInfo.make`):
#: standalone; ``overlap=True`` (its communication starts from gradient hooks, on a thread);
#: under DDP with commopt's hook (the optimizer is built standalone, the test registers
#: ``commopt.ddp.onebit_hook`` on its DDP model); the hierarchical topology; EControl error
#: feedback. Every mode but EControl is bit-identical to the standalone optimizer.
MODES: Mapping[str, Mapping[str, Any]] = {
    "standalone": {},
    "overlap": {"overlap": True},
    "ddp-hook": {},
    "hierarchical": {"topology": "hierarchical"},
    "econtrol": {"error_feedback": "econtrol"},
}

#: Where an optimizer runs: its parameters' device. ``"cuda"`` only where a GPU is visible
#: (:func:`devices`).
DEVICES = ("cpu", "cuda")


def devices() -> list[str]:
    """The devices of :data:`DEVICES` this process can use."""
    return [d for d in DEVICES if d == "cpu" or torch.cuda.is_available()]


# -- the registry --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Phase:
    """The steps of one phase of an optimizer's schedule (counted from 1, as ``step()`` does).

    Attributes:
        name: short name, used in test ids (``warmup``, ``B-local`` …).
        steps: this phase's steps within the test run, ascending (never empty).
        communicates: the phase's steps talk to other ranks, so replicas are bit-identical
            after each of them and a non-finite gradient on one rank skips the step on all.
            A purely local step (0/1 Adam between syncs) communicates nothing: a non-finite
            gradient drops only that rank's update, and the replicas differ until the next sync.
        masks_momentum: after each of its steps, ``exp_avg`` is exactly 0 where the group's
            ``exp_avg_mask`` is 0 (the mask is applied to what a compressed exchange returns).
        updates_variance: its steps update ``exp_avg_sq`` from the averaged gradient (after
            the last of them the variance is frozen).
        resets_errors: its first step zeroes the error-feedback buffers before it exchanges
            (0/1 Adam's phase-B entry: from then on they compensate accumulated updates, not
            gradients), so errors saved just before it do not matter.
    """

    name: str
    steps: tuple[int, ...]
    communicates: bool = True
    masks_momentum: bool = False
    updates_variance: bool = False
    resets_errors: bool = False

    @property
    def first(self) -> int:
        return self.steps[0]


@dataclass(frozen=True)
class ErrorCase:
    """A constructor call that must fail: ``cls(params(), **kwargs)`` raises ``error`` whose
    message matches the regex ``match`` (``re.search``)."""

    kwargs: Mapping[str, Any]
    error: type[Exception]
    match: str
    params: Callable[[], Any] | None = None  # default: one small parameter

    def build_params(self) -> Any:
        if self.params is not None:
            return self.params()
        return [torch.nn.Parameter(torch.zeros(3, 4))]

    @property
    def id(self) -> str:
        what = ",".join(f"{k}={v!r}" for k, v in self.kwargs.items()) or "params"
        return f"{self.error.__name__}-{what}"


@dataclass(frozen=True)
class OptimizerInfo:
    """What the generic tests need to know about one optimizer.

    Attributes:
        name: the public name (``commopt.<name>``).
        cls: the class.
        config: keyword arguments of the small test configuration (schedule and defaults);
            per-group hyperparameters come from ``make_groups``.
        schedule: ``schedule(config, steps)`` → the phases of a run of ``steps`` steps, from
            the SPEC's prose (not from the optimizer).
        steps: the length of a test run: every phase occurs and the last step communicates,
            so replicas agree at the end.
        error_inputs: invalid constructor arguments (type, message regex).
        state_keys: per-parameter state every parameter has once stepped (``state[p]``).
        variants: other hyperparameters (overrides of ``config`` with the same schedule), as
            torch's ``optim_inputs_func``: the generic tests run the main config, some of them
            these too.
        extra_global_keys: ``global_state`` keys besides ``step`` and ``skipped_steps``.
        backward_config: the schedule of the tests of work started during backward (overlap,
            the DDP hook), whose models take several buckets: 8 steps that visit every phase
            (1-bit Adam and LAMB: warmup 1–3, compression 4–8; 0/1 Adam: variance steps 1, 2, 4
            and 1-bit steps 3, 5, then phase B with syncs at 6 and 8), with weight decay.
        synced_copy: the per-parameter state key of the parameters as of the last sync, which
            the replicas share after a local step (0/1 Adam's ``p_sync``); None: every step
            communicates.
        joins_after_freeze: a param group added after the freeze runs its own warmup; False:
            it is refused (0/1 Adam's variance is frozen for every parameter at once).
        dense_variance: overrides under which v is updated on every one of the first tens of
            steps and settles within them, as the automatic freeze's tests need (0/1 Adam:
            ``var_update_scaler=32`` and β2 = 0.95; the 1-bit optimizers update v on every
            warmup step).
        options: switches that take another code path (not just other numbers, as
            ``variants``): each is run by the tests of work started during backward.
    """

    name: str
    cls: type[torch.optim.Optimizer]
    config: Mapping[str, Any]
    schedule: Callable[[Mapping[str, Any], int], list[Phase]]
    steps: int
    error_inputs: tuple[ErrorCase, ...]
    state_keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    variants: tuple[Mapping[str, Any], ...] = ()
    extra_global_keys: tuple[str, ...] = field(default=())
    backward_config: Mapping[str, Any] = field(default_factory=dict)
    synced_copy: str | None = None
    joins_after_freeze: bool = True
    dense_variance: Mapping[str, Any] = field(default_factory=dict)
    options: tuple[Mapping[str, Any], ...] = ()

    @property
    def freeze_key(self) -> str:
        """The config key of the last full-precision step (1-bit: ``freeze_step``; 0/1 Adam:
        ``var_freeze_step``)."""
        return "var_freeze_step" if "var_freeze_step" in self.config else "freeze_step"

    def make(
        self,
        params: Any,
        *,
        mode: str = "standalone",
        backward: bool = False,
        freeze: int | None = None,
        **overrides: Any,
    ) -> torch.optim.Optimizer:
        """The optimizer on ``params`` in ``mode`` (:data:`MODES`) with the test config, or with
        ``backward`` the backward-time tests' config; ``freeze`` moves the end of the
        full-precision phase (:attr:`freeze_key`) and keeps the rest of the schedule;
        ``overrides`` win. Its device is the parameters'."""
        config = self.backward_config if backward else self.config
        if freeze is not None:
            config = {**config, self.freeze_key: freeze}
        return self.cls(params, **{**config, **MODES[mode], **overrides})

    def phases(
        self, steps: int | None = None, freeze: int | None = None, backward: bool = False
    ) -> list[Phase]:
        """The phases of a run of ``steps`` steps of the test config (``freeze`` and
        ``backward`` as in :meth:`make`)."""
        config = self.backward_config if backward else self.config
        if freeze is not None:
            config = {**config, self.freeze_key: freeze}
        return self.schedule(config, self.steps if steps is None else steps)

    def communicates(self, step: int, freeze: int | None = None, backward: bool = False) -> bool:
        """Whether ``step`` of the test config (``freeze`` and ``backward`` as in :meth:`make`)
        talks to other ranks: after such a step the replicas are bit-identical."""
        phases = self.phases(max(step, self.steps), freeze, backward)
        return any(step in ph.steps and ph.communicates for ph in phases)

    def phase_of(self, step: int) -> Phase:
        for phase in self.phases(max(step, self.steps)):
            if step in phase.steps:
                return phase
        raise ValueError(f"{self.name}: step {step} is in no phase")

    def phase_starts(self, steps: int, backward: bool = False) -> list[tuple[int, str]]:
        """(first step, phase name) of each phase that communicates, in step order."""
        starts = [(ph.first, ph.name) for ph in self.phases(steps, backward=backward)]
        return sorted(start for start in starts if self.communicates(start[0], backward=backward))

    def shared(
        self, opt: torch.optim.Optimizer, params: Any, freeze: int | None = None
    ) -> torch.Tensor:
        """The parameters every replica holds bit for bit after ``opt``'s last step, flat: the
        parameters, or after a local step their :attr:`synced_copy`."""
        step = opt.global_state["step"]
        local = self.synced_copy is not None and not self.communicates(step, freeze)
        parts = [opt.state[p][self.synced_copy] if local else p for p in params]
        return torch.cat([t.detach().float().reshape(-1) for t in parts])

    def resume_points(self) -> list[int]:
        """Steps after which to save for a resume "in every phase": just before each phase
        starts (the next step crosses into it) and just after its first step (inside it)."""
        points = {k for ph in self.phases() for k in (ph.first - 1, ph.first)}
        return sorted(k for k in points if 0 < k < self.steps)

    def __repr__(self) -> str:  # short pytest ids
        return self.name


def _onebit_adam_schedule(config: Mapping[str, Any], steps: int) -> list[Phase]:
    """SPEC §2: warmup t = 1 … freeze_step (full precision), then compression."""
    freeze = config["freeze_step"]
    return [
        Phase("warmup", tuple(range(1, freeze + 1)), updates_variance=True),
        Phase("compression", tuple(range(freeze + 1, steps + 1)), masks_momentum=True),
    ]


def _onebit_lamb_schedule(config: Mapping[str, Any], steps: int) -> list[Phase]:
    """SPEC §3: LAMB warmup; at t = freeze_step v_f = v is kept; at t = freeze_step + 1 σ is
    frozen (the first compressed step); then compression."""
    freeze = config["freeze_step"]
    return [
        Phase("warmup", tuple(range(1, freeze)), updates_variance=True),
        Phase("freeze", (freeze,), updates_variance=True),
        Phase("scaling", (freeze + 1,), masks_momentum=True),
        Phase("compression", tuple(range(freeze + 2, steps + 1)), masks_momentum=True),
    ]


def zero_one_steps(config: Mapping[str, Any], steps: int) -> tuple[list[int], list[int]]:
    """SPEC §4's two schedules: (variance steps of phase A, sync steps of phase B)."""
    variance, sync = [], []
    interval, counter = 1, 0
    for t in range(1, config["var_freeze_step"] + 1):
        if t % interval == 0:
            variance.append(t)
            counter += 1
            if counter == config["var_update_scaler"]:
                counter, interval = 0, interval * 2
    interval, counter = 1, 0
    for t in range(config["var_freeze_step"] + 1, steps + 1):
        if t % interval == 0:
            sync.append(t)
        counter += 1
        if counter == config["local_step_scaler"]:
            counter, interval = 0, min(config["local_step_clipper"], 2 * interval)
    return variance, sync


def _zero_one_adam_schedule(config: Mapping[str, Any], steps: int) -> list[Phase]:
    """SPEC §4: phase A variance steps (fp32 average) and 1-bit steps (compressed gradient);
    phase B: its entry (a sync, I_l = 1), later syncs, and local steps in between."""
    variance, sync = zero_one_steps(config, steps)
    freeze = config["var_freeze_step"]
    return [
        Phase("A-variance", tuple(variance), updates_variance=True),
        Phase("A-1bit", tuple(t for t in range(1, freeze + 1) if t not in variance)),
        Phase("B-entry", (freeze + 1,), masks_momentum=True, resets_errors=True),
        Phase("B-sync", tuple(t for t in sync if t > freeze + 1), masks_momentum=True),
        Phase(
            "B-local",
            tuple(t for t in range(freeze + 1, steps + 1) if t not in sync),
            communicates=False,
        ),
    ]


# Invalid arguments. The Adam-family checks every optimizer makes (torch.optim's wording).
_ADAM_ERRORS = (
    ErrorCase({"lr": -1e-3}, ValueError, r"Invalid learning rate: -0\.001"),
    ErrorCase({"lr": -0.1}, ValueError, r"Invalid learning rate: -0\.1"),
    ErrorCase({"lr": float("nan")}, ValueError, "Invalid learning rate: nan"),
    ErrorCase({"eps": -1.0}, ValueError, "Invalid epsilon value"),
    ErrorCase({"eps": -1e-8}, ValueError, "Invalid epsilon value"),
    ErrorCase({"weight_decay": -0.1}, ValueError, "Invalid weight_decay value"),
    ErrorCase({"weight_decay": -1.0}, ValueError, "Invalid weight_decay value"),
    ErrorCase({"betas": (1.0, 0.999)}, ValueError, r"Invalid beta parameter at index 0: 1\.0"),
    ErrorCase({"betas": (-0.5, 0.9)}, ValueError, r"Invalid beta parameter at index 0: -0\.5"),
    ErrorCase({"betas": (0.9, -0.1)}, ValueError, r"Invalid beta parameter at index 1: -0\.1"),
    ErrorCase({"betas": (0.9, 1.0)}, ValueError, r"Invalid beta parameter at index 1: 1\.0"),
)

# What the base class checks for every optimizer: torch's empty-list error, the momentum mask,
# and the overlap switch with its bucket size (commopt.optim._early).
_BASE_ERRORS = (
    ErrorCase({"bucket_numel": 0}, ValueError, r"Invalid bucket_numel: 0 \(must be >= 1\)"),
    ErrorCase({"bucket_numel": 1e6}, TypeError, "bucket_numel must be an int, got float"),
    ErrorCase({"bucket_numel": True}, TypeError, "bucket_numel must be an int, got bool"),
    ErrorCase({"overlap": "yes"}, TypeError, "overlap must be True or False, got 'yes'"),
    ErrorCase({}, ValueError, "optimizer got an empty parameter list", params=lambda: []),
    ErrorCase(
        {},
        ValueError,
        r"exp_avg_mask of shape \(5,\) does not broadcast to a parameter of shape \(3, 4\)",
        params=lambda: [
            {"params": [torch.nn.Parameter(torch.zeros(3, 4))], "exp_avg_mask": torch.ones(5)}
        ],
    ),
    ErrorCase(
        {},
        TypeError,
        "exp_avg_mask must be a tensor, got list",
        params=lambda: [
            {"params": [torch.nn.Parameter(torch.zeros(3, 4))], "exp_avg_mask": [1, 0, 1, 1]}
        ],
    ),
)


def _step_count_errors(name: str, why: str, negative: int = -3) -> tuple[ErrorCase, ...]:
    """A schedule length: an int >= 1 (0 and negatives say why; floats and bools are types)."""
    return (
        ErrorCase({name: 0}, ValueError, rf"Invalid {name}: 0 \(must be >= 1: {why}"),
        ErrorCase({name: negative}, ValueError, rf"Invalid {name}: {negative} \(must be >= 1"),
        ErrorCase({name: 2.5}, TypeError, rf"Invalid {name}: 2\.5 \(must be an int"),
        ErrorCase({name: 2.0}, TypeError, rf"Invalid {name}: 2\.0 \(must be an int"),
        ErrorCase({name: True}, TypeError, rf"Invalid {name}: True \(must be an int"),
    )


_FREEZE_WHY = "the variance has to be estimated before it is frozen"
_SCALER_WHY = "it counts steps between doublings of an interval"

OPTIMIZERS: tuple[OptimizerInfo, ...] = (
    OptimizerInfo(
        name="OnebitAdam",
        cls=commopt.OnebitAdam,
        config={"lr": 1e-2, "freeze_step": 3},
        schedule=_onebit_adam_schedule,
        steps=6,
        error_inputs=(
            *_ADAM_ERRORS,
            *_BASE_ERRORS,
            *_step_count_errors("freeze_step", _FREEZE_WHY),
        ),
        variants=({"bias_correction": False, "weight_decay": 0.02, "eps": 1e-6},),
        backward_config={"lr": 0.02, "freeze_step": 3, "weight_decay": 0.01},
    ),
    OptimizerInfo(
        name="OnebitLamb",
        cls=commopt.OnebitLamb,
        config={"lr": 5e-2, "freeze_step": 3},
        schedule=_onebit_lamb_schedule,
        steps=7,
        error_inputs=(
            *_ADAM_ERRORS,
            *_BASE_ERRORS,
            *_step_count_errors("freeze_step", _FREEZE_WHY),
            ErrorCase(
                {"min_coeff": 0.5, "max_coeff": 0.1},
                ValueError,
                r"Invalid max_coeff: 0\.1 \(must be >= min_coeff = 0\.5\)",
            ),
            ErrorCase({"min_coeff": -0.1}, ValueError, r"Invalid min_coeff: -0\.1"),
            ErrorCase({"coeff_beta": 1.0}, ValueError, r"coeff_beta: 1\.0"),
            ErrorCase(
                {"factor_min": 2.0, "factor_max": 1.0},
                ValueError,
                r"Invalid factor_max: 1\.0 \(must be >= factor_min = 2\.0\)",
            ),
            ErrorCase({"factor_threshold": -0.1}, ValueError, r"Invalid factor_threshold: -0\.1"),
            # 1-bit LAMB has no bias correction (SPEC §3): not an argument at all
            ErrorCase({"bias_correction": True}, TypeError, "bias_correction"),
        ),
        state_keys=(
            "exp_avg",
            "exp_avg_sq",
            "lamb_coeff_freeze",
            "scaling_coeff",
            "last_factor",
            "lamb_coeff",
        ),
        variants=(
            {"weight_decay": 0.02, "factor_threshold": 0.3, "max_coeff": 0.5, "coeff_beta": 0.5},
        ),
        options=({"trust_ratio": "tracking"}, {"trust_ratio": "max"}),
        backward_config={"lr": 0.02, "freeze_step": 3, "weight_decay": 0.01},
    ),
    OptimizerInfo(
        name="ZeroOneAdam",
        cls=commopt.ZeroOneAdam,
        # variance steps 1, 2, 4, 6 (3, 5 send a 1-bit gradient); phase B from 7: I_l = 1 for
        # 7, 8, then 2 (sync 10), then 4 (sync 12)
        config={
            "lr": 1e-2,
            "var_freeze_step": 6,
            "var_update_scaler": 2,
            "local_step_scaler": 2,
            "local_step_clipper": 4,
        },
        schedule=_zero_one_adam_schedule,
        steps=12,
        error_inputs=(
            *_ADAM_ERRORS,
            *_BASE_ERRORS,
            *_step_count_errors("var_freeze_step", _FREEZE_WHY),
            *_step_count_errors("var_update_scaler", _SCALER_WHY),
            *_step_count_errors("local_step_scaler", _SCALER_WHY, negative=-2),
            *_step_count_errors("local_step_clipper", "it is the largest local-step interval"),
            # 0/1 Adam's schedule is var_freeze_step; 1-bit Adam's name is not accepted
            ErrorCase({"freeze_step": 10}, TypeError, "freeze_step"),
        ),
        variants=({"weight_decay": 0.02, "eps": 1e-6, "betas": (0.5, 0.9)},),
        extra_global_keys=(
            "var_interval",
            "var_counter",
            "local_interval",
            "local_counter",
            "local_started",
            "lrs",
        ),
        synced_copy="p_sync",
        joins_after_freeze=False,
        dense_variance={"var_update_scaler": 32, "betas": (0.9, 0.95)},
        options=({"bias_correction": False},),
        backward_config={
            "lr": 0.02,
            "weight_decay": 0.01,
            "var_freeze_step": 5,
            "var_update_scaler": 2,
            "local_step_scaler": 1,
            "local_step_clipper": 2,
        },
    ),
)

#: the registry by name
BY_NAME: Mapping[str, OptimizerInfo] = {info.name: info for info in OPTIMIZERS}


# -- model, data, training -----------------------------------------------------------------------
IN, HIDDEN, OUT = 5, 6, 2


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Sequential:
    """Two linear layers (four tensors); ``seed`` picks the initial values."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT)
    )
    return model.to(dtype)


def make_groups(model: torch.nn.Module, mask: torch.Tensor | None = None) -> list[dict]:
    """Two param groups with different hyperparameters: the first weight (with weight decay,
    optionally masked by ``exp_avg_mask``) and the other three tensors (other lr and betas)."""
    p = list(model.parameters())
    first: dict[str, Any] = {"params": p[:1], "weight_decay": 0.01}
    if mask is not None:
        first["exp_avg_mask"] = mask
    return [first, {"params": p[1:], "lr": 2e-2, "betas": (0.8, 0.99)}]


def first_layer_mask() -> torch.Tensor:
    """A 0/1 mask for the first weight (HIDDEN × IN): one row and one column masked."""
    mask = torch.ones(HIDDEN, IN)
    mask[1] = 0
    mask[:, 3] = 0
    return mask


def batch(rank: int, step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """This rank's data for ``step``: every rank and every step its own."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, IN, generator=gen) * (1 + rank)
    return x.to(dtype), torch.sin(x[:, :OUT]).to(dtype)


def loss_of(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    x, y = batch(rank, step, dtype)
    return ((model(x).float() - y.float()) ** 2).mean()


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    opt.zero_grad()
    loss_of(model, rank, step).backward()
    opt.step()


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """All parameters as one fp32 vector (bf16/fp16 values convert exactly)."""
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


# -- comparisons ---------------------------------------------------------------------------------
def snapshot(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Copies of the parameters, every per-parameter state value and ``global_state``."""
    snap: dict[str, Any] = {}
    for i, p in enumerate(params):
        snap[f"param{i}"] = p.detach().clone()
        for key, value in opt.state[p].items():
            snap[f"state{i}.{key}"] = value.clone() if torch.is_tensor(value) else value
    snap["global_state"] = _copy(getattr(opt, "global_state", {}))
    return snap


def snapshot_diff(
    a: dict[str, Any], b: dict[str, Any], skip: tuple[str, ...] = (), allow_new: bool = False
) -> list[str]:
    """Names whose values differ (bit for bit; dtype and shape included). ``allow_new``: names
    only ``b`` has are fine (state that an optimizer creates lazily, as torch's do)."""
    names = set(a) if allow_new else set(a) | set(b)
    return [k for k in sorted(names) if k not in skip and not _same(a.get(k), b.get(k))]


def state_dict_diff(a: Any, b: Any, path: str = "", allow_new: bool = False) -> list[str]:
    """Paths where two ``state_dict()``s (or any nested structures) differ, bit for bit.
    ``allow_new``: dict keys only ``b`` has are fine."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        missing = set(a) - set(b) if allow_new else set(a) ^ set(b)
        out = [f"{path}/{k}: missing on one side" for k in missing]
        for k in sorted(set(a) & set(b), key=str):
            out += state_dict_diff(a[k], b[k], f"{path}/{k}", allow_new)
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in state_dict_diff(x, y, f"{path}[{i}]", allow_new)
        ]
    return [] if _same(a, b) else [path or "/"]


def outside(diff: list[str], keys: set[str] | list[str]) -> list[str]:
    """The paths of a ``state_dict_diff`` that are not under one of ``keys`` (by the last
    key: ``/commopt/global/lrs[0]`` is under ``lrs``), wherever the state_dict keeps them."""
    return [d for d in diff if re.sub(r"\[\d+\]$", "", d.rsplit("/", 1)[-1]) not in keys]


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (
            torch.is_tensor(a)
            and torch.is_tensor(b)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    return state_dict_diff(a, b) == [] if isinstance(a, (Mapping, list, tuple)) else a == b


def _copy(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


def reload(obj: Any) -> Any:
    """``obj`` through ``torch.save``/``torch.load`` in memory (as a checkpoint file would)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)
