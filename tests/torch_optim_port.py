"""torch's generic optimizer tests, ``TestOptimRenewed``, ported to commopt's optimizers (#38).

The bodies and assertions follow pytorch's ``test/test_optim.py`` (torch 2.13), one function per
test there, same name. The inputs are Adam's ``OptimizerInfo`` from
``torch/testing/_internal/common_optimizers.py``: ``optim_inputs_func_adam``,
``optim_error_inputs_func_adam`` (with ``get_error_inputs_for_all_optims``) and Adam's
``scheduler_inputs``, copied here for the CPU because that module needs torch's own test
dependencies (``expecttest``).

Who runs them (:data:`ENTRIES`): ``torch.optim.Adam``, the control, with Adam's own
implementation flags (foreach, differentiable, fused); and each optimizer of
``tests/optim_registry.py`` twice: with the registry's short schedule merged under every
constructor call (so that the tests' 3–20 steps cross from the full-precision warmup into the
compressed phases) and with the library's defaults. commopt's optimizers accept ``foreach``
(their flat kernels are one implementation, so it is a no-op) and the other flags when False.

Where a torch feature does not apply, the row checks the refusal instead, in the constructor
(docs/optimizers.md lists them): ``maximize``, ``amsgrad``, ``capturable``, ``differentiable``
and ``fused`` set True, a tensor ``lr`` or ``betas`` (refused with torch's own wording for the
configurations where torch refuses them), complex and float64 parameters. Rows torch runs on
CUDA only or for other optimizers (sparse, second order, multi-GPU, memory) have no CPU row.

The bodies take a :class:`World`: the unit suite runs them in one process
(``tests/unit/test_torch_optim_port.py``) and the rows where communication matters on 2 gloo
ranks (``tests/multirank/test_torch_optim_port_gloo.py``), each rank with its own data.
"""

from __future__ import annotations

import functools
import io
import math
import re
from collections.abc import Callable, Mapping
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import Parameter
from torch.optim import SGD, Optimizer
from torch.optim.lr_scheduler import (
    ConstantLR,
    ExponentialLR,
    LinearLR,
    PolynomialLR,
    ReduceLROnPlateau,
    StepLR,
)
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

import commopt
from tests.optim_registry import OPTIMIZERS


# -- Adam's OptimizerInfo (torch 2.13, CPU) ------------------------------------------------------
def optim_inputs_func_adam() -> list[tuple[str, dict[str, Any]]]:
    """``optim_inputs_func_adam(device="cpu")``: (desc, kwargs), fresh on every call."""
    return [
        ("default", {}),
        ("non-default lr", {"lr": 0.01}),
        ("nonzero weight_decay", {"weight_decay": 0.1}),
        ("maximize", {"weight_decay": 0.1, "maximize": True}),
        ("amsgrad", {"weight_decay": 0.1, "amsgrad": True}),
    ]


#: Adam's ``scheduler_inputs``
ADAM_SCHEDULERS: tuple[list[Callable[[Optimizer], Any]], ...] = (
    [lambda opt: ExponentialLR(opt, gamma=0.9)],
    [lambda opt: LinearLR(opt, start_factor=0.4, total_iters=4)],
    [lambda opt: ConstantLR(opt, factor=0.4, total_iters=4), lambda opt: ExponentialLR(opt, 0.9)],
    [lambda opt: ExponentialLR(opt, gamma=0.9), lambda opt: ReduceLROnPlateau(opt)],
    [lambda opt: ConstantLR(opt, factor=0.4, total_iters=4)],
    [lambda opt: PolynomialLR(opt, power=0.9, total_iters=4)],
    [lambda opt: StepLR(opt, gamma=0.9, step_size=10), lambda opt: ReduceLROnPlateau(opt)],
)


@dataclass(frozen=True)
class ErrorInput:
    """One of ``optim_error_inputs_func_adam``'s: ``cls(params, **kwargs)`` (or, ``on_step``,
    its first ``step()``) raises or warns ``error`` matching ``regex``."""

    desc: str
    params: Callable[[], Any]
    kwargs: Callable[[], dict[str, Any]]
    error: type[BaseException]
    regex: str
    on_step: bool = False


def optim_error_inputs_func_adam() -> list[ErrorInput]:
    """``optim_error_inputs_func_adam(device="cpu", dtype=torch.float32)``."""
    a = Parameter(torch.randn(1, 1))
    b = Parameter(torch.randn(1, 1))
    none: Callable[[], Any] = lambda: None  # noqa: E731  (torch passes params=None)
    return [
        ErrorInput(
            "invalid param type",
            lambda: a,
            dict,
            TypeError,
            "params argument given to the optimizer should be an iterable of Tensors or dicts",
        ),
        ErrorInput(
            "a param group cannot have duplicate parameters",
            lambda: [a, a],
            dict,
            UserWarning,
            ".*a parameter group with duplicate parameters.*",
        ),
        ErrorInput(
            "duplicate parameters should not occur across param groups either",
            lambda: [{"params": a}, {"params": a}],
            dict,
            ValueError,
            "some parameters appear in more than one parameter group",
        ),
        ErrorInput(
            "Tensor lr must be 1-element",
            none,
            lambda: {"lr": torch.tensor([0.001, 0.001])},
            ValueError,
            "Tensor lr must be 1-element",
        ),
        ErrorInput(
            "all optimizer params should be with/without names",
            lambda: [("weight", a), b],
            dict,
            ValueError,
            "all optimizer params should be with/without names. Some param names are missing",
        ),
        ErrorInput(
            "all optimizer param groups should be with/without names.",
            lambda: [{"params": [a], "lr": 1e-2}, {"params": [("weight", b)]}],
            dict,
            ValueError,
            "all optimizer param groups should be with/without names. "
            "cannot add param group with names to the optimizer",
        ),
        ErrorInput(
            "beta1 should be between 0 and 1",
            none,
            lambda: {"lr": 1e-2, "betas": (1.0, 0.0)},
            ValueError,
            "Invalid beta parameter at index 0: 1.0",
        ),
        ErrorInput(
            "weight_decay should > 0",
            none,
            lambda: {"lr": 1e-2, "weight_decay": -1},
            ValueError,
            "Invalid weight_decay value: -1",
        ),
        ErrorInput(
            "lr as Tensor doesn't work with foreach & not capturable",
            none,
            lambda: {"lr": torch.tensor(0.001), "foreach": True},
            ValueError,
            "lr as a Tensor is not supported for capturable=False and foreach=True",
        ),
        ErrorInput(
            "betas must be either both floats or both Tensors",
            none,
            lambda: {"lr": 1e-2, "betas": (0.9, torch.tensor(0.99))},
            ValueError,
            "betas must be either both floats or both Tensors",
        ),
        ErrorInput(
            "betas must be either both floats or both Tensors",
            none,
            lambda: {"lr": 1e-2, "betas": (torch.tensor(0.9), 0.99)},
            ValueError,
            "betas must be either both floats or both Tensors",
        ),
        ErrorInput(
            r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True",
            none,
            lambda: {"lr": 1e-2, "betas": (torch.tensor(0.9), torch.tensor(0.99)), "foreach": True},
            ValueError,
            r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True",
        ),
    ]


#: Adam's flags that came after its first release (``not_og_supported_flags``)
NOT_OG_SUPPORTED_FLAGS = ("foreach", "differentiable", "fused", "maximize", "capturable")

#: what commopt's optimizers refuse when set (True), and torch.optim.Adam has
REFUSED_FLAGS = ("maximize", "amsgrad", "capturable", "differentiable", "fused")


# -- who runs them -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """An optimizer under the ported tests (torch's ``OptimizerInfo`` for one class).

    Attributes:
        name: test id.
        cls: the class.
        base: keyword arguments merged under every constructor call (the short schedule).
        supported_impls: the global-cliquey flags it takes (``foreach``, ``fused``, ...).
        commopt: one of commopt's optimizers: refuses :data:`REFUSED_FLAGS`, tensor
            hyperparameters, complex and float64 parameters.
        fp32_or_lower: refuses complex and float64 parameters (commopt's optimizers do too).
        deep_copies: ``copy.deepcopy`` works; else it raises ``TypeError`` (DiLoCo: its
            backend's process groups and communication thread cannot be copied).
    """

    name: str
    cls: type[Optimizer]
    base: Mapping[str, Any] = field(default_factory=dict)
    supported_impls: tuple[str, ...] = ("foreach",)
    commopt: bool = True
    fp32_or_lower: bool = False
    deep_copies: bool = True

    def make(self, params: Any, **kwargs: Any) -> Optimizer:
        return self.cls(params, **{**self.base, **kwargs})

    def optim_inputs(self) -> list[dict[str, Any]]:
        return [kwargs for _, kwargs in optim_inputs_func_adam()]

    def all_inputs(self, skip: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        """``_get_optim_inputs_including_global_cliquey_kwargs``: each input with every
        supported flag False, then with each one True."""
        impls = [f for f in self.supported_impls if f not in skip]
        out = []
        for kwargs in self.optim_inputs():
            base = {**kwargs, **{f: False for f in impls}}
            out.append(base)
            out += [{**deepcopy(base), f: True} for f in impls]
        return out

    def refusal(self, kwargs: Mapping[str, Any]) -> tuple[type[Exception], str] | None:
        """(error, regex) when this optimizer refuses ``kwargs``, else None."""
        if not self.commopt:
            return None
        for flag in REFUSED_FLAGS:
            if kwargs.get(flag):
                return ValueError, rf"{flag}=True: {self.cls.__name__} has no {flag}"
        if isinstance(kwargs.get("lr"), torch.Tensor):
            return ValueError, "lr as a Tensor is not supported"
        if any(isinstance(b, torch.Tensor) for b in kwargs.get("betas", ())):
            return ValueError, "as a Tensor is not supported|both floats or both Tensors"
        return None

    def refuses_dtype(self, dtype: torch.dtype) -> bool:
        return (self.commopt or self.fp32_or_lower) and (dtype.is_complex or dtype == torch.float64)

    def __repr__(self) -> str:
        return self.name


class DiLoCoAdam(commopt.DiLoCo):
    """torch's Adam inside :class:`commopt.DiLoCo`, the bodies' keyword arguments passed to
    the Adam: a sync every second step (the bodies take 3-20 steps), the first at fp32 and the
    others at one bit."""

    def __init__(self, params: Any, sync_every: int = 2, fp32_syncs: int = 1, **kwargs: Any):
        inner = torch.optim.Adam(params, **kwargs)
        super().__init__(inner, sync_every=sync_every, fp32_syncs=fp32_syncs)


ADAM_IMPLS = ("foreach", "differentiable", "fused")
ENTRIES: tuple[Entry, ...] = (
    Entry("Adam", torch.optim.Adam, {}, ADAM_IMPLS, commopt=False),
    *(Entry(info.name, info.cls, dict(info.config)) for info in OPTIMIZERS),
    *(Entry(f"{info.name}-defaults", info.cls) for info in OPTIMIZERS),
    Entry("DiLoCo-Adam", DiLoCoAdam, {}, ADAM_IMPLS, False, fp32_or_lower=True, deep_copies=False),
)

#: the commopt rows whose tests run long enough to leave the warmup (on the short schedule)
SHORT = tuple(e for e in ENTRIES if e.commopt and e.base)


class World:
    """Where a body runs: seeds the parameters alike on every rank and the data per rank; on
    several ranks, :meth:`agree` checks that the replicas hold the same parameters."""

    rank = 0

    def seed_params(self) -> None:
        torch.manual_seed(0)

    def seed_data(self) -> None:
        torch.manual_seed(1000 + self.rank)

    def mean(self, loss: Any) -> float:
        """The loss as every rank measures progress: its mean over the ranks (each rank has its
        own data; the optimizer minimises their mean), so a plateau scheduler stepped on it
        steps alike everywhere."""
        return float(loss)

    def agree(self, entry: Entry, optimizer: Optimizer, params: list[torch.Tensor]) -> None:
        """After ``optimizer``'s last step every rank holds the same parameters (those of the
        last sync, after a local step of 0/1 Adam). One process: nothing to compare."""


ONE_PROCESS = World()


def build(entry: Entry, params: Any, kwargs: Mapping[str, Any]) -> Optimizer | None:
    """``entry``'s optimizer, or None once it refused ``kwargs`` as :meth:`Entry.refusal` says."""
    refused = entry.refusal(kwargs)
    if refused is None:
        return entry.make(params, **kwargs)
    error, regex = refused
    try:
        entry.make(params, **kwargs)
    except error as e:
        assert re.search(regex, str(e)), f"{entry}: {kwargs} refused as {e!r}, not /{regex}/"
        return None
    raise AssertionError(f"{entry}: {kwargs} was accepted; it should be refused /{regex}/")


def assert_same(a: Any, b: Any, where: str = "", exact: bool = False, **tol: float) -> None:
    """torch's ``TestCase.assertEqual``: tensors within the dtype's default tolerance (or
    ``tol``; ``exact``: bit for bit), NaN equal to NaN, recursing into containers."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        if exact:
            tol = {"rtol": 0.0, "atol": 0.0}
        torch.testing.assert_close(a, b, equal_nan=True, msg=lambda m: f"{where}: {m}", **tol)
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping) and set(a) == set(b), f"{where}: keys {set(a) ^ set(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}", exact, **tol)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {a} vs {b}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]", exact, **tol)
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _step_schedulers(schedulers: list[Any], loss: Any, world: World) -> None:
    if any(isinstance(s, ReduceLROnPlateau) for s in schedulers):
        loss = world.mean(loss)
    for scheduler in schedulers:
        if isinstance(scheduler, ReduceLROnPlateau):
            scheduler.step(loss)
        else:
            scheduler.step()


# -- the bodies, one per test of TestOptimRenewed -------------------------------------------------
def test_optim_infos_do_not_specify_global_cliquey_kwargs(entry: Entry, world: World) -> None:
    for kwargs in entry.optim_inputs():
        assert not any(f in kwargs for f in ("foreach", "fused", "differentiable"))


def test_errors(entry: Entry, world: World) -> None:
    import warnings

    for case in optim_error_inputs_func_adam():
        params, kwargs = case.params(), case.kwargs()
        if issubclass(case.error, Warning):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt = entry.make(params, **kwargs)
                if case.on_step:
                    opt.step()
            texts = [str(w.message) for w in caught if issubclass(w.category, case.error)]
            assert any(re.search(case.regex, t) for t in texts), f"{case.desc}: {texts}"
            continue
        try:
            opt = entry.make(params, **kwargs)
            if case.on_step:
                opt.step()
        except case.error as e:
            assert re.search(case.regex, str(e)), f"{entry} {case.desc}: {e}"
        else:
            raise AssertionError(f"{entry} {case.desc}: no {case.error.__name__}")


def test_forloop_goes_right_direction(
    entry: Entry, world: World, contiguous: bool, with_lrsched: bool
) -> None:
    for schedulers_c in ADAM_SCHEDULERS if with_lrsched else [None]:
        for kwargs in entry.optim_inputs():
            kwargs["foreach"] = False  # force forloop
            world.seed_params()
            if contiguous:
                weight = Parameter(torch.randn((10, 5)))
                bias = Parameter(torch.randn(10))
            else:
                weight = Parameter(torch.randn((10, 5, 2))[..., 0])
                bias = Parameter(torch.randn((10, 2))[..., 0])
            world.seed_data()
            inpt = torch.randn(5)
            optimizer = build(entry, [weight, bias], kwargs)
            if optimizer is None:
                continue
            schedulers = [s(optimizer) for s in (schedulers_c or [])]

            def closure():
                optimizer.zero_grad()
                loss = (weight.mv(inpt) + bias).pow(2).sum()
                loss.backward()
                return loss

            initial_value = world.mean(closure().item())
            for _ in range(20):
                loss = closure()
                optimizer.step()
                _step_schedulers(schedulers, loss, world)
            world.agree(entry, optimizer, [weight, bias])
            if kwargs.get("maximize", False):
                assert world.mean(closure().item()) > initial_value
            else:
                assert world.mean(closure().item()) < initial_value, (entry, kwargs)


def test_param_group_with_lrscheduler_goes_right_direction(entry: Entry, world: World) -> None:
    for schedulers_c in ADAM_SCHEDULERS:
        world.seed_params()
        weight = Parameter(torch.randn((10, 5)))
        bias = Parameter(torch.randn(10))
        world.seed_data()
        inpt = torch.randn(5)
        optimizer = entry.make([{"params": [weight]}, {"params": [bias], "lr": 0.01}])
        schedulers = [s(optimizer) for s in schedulers_c]

        def closure():
            optimizer.zero_grad()
            loss = (weight.mv(inpt) + bias).pow(2).sum()
            loss.backward()
            return loss

        initial_value = world.mean(closure().item())
        for _ in range(20):
            loss = optimizer.step(closure)
            _step_schedulers(schedulers, loss, world)
        world.agree(entry, optimizer, [weight, bias])
        assert world.mean(closure().item()) < initial_value


def test_tensor_lr(entry: Entry, world: World) -> None:
    for kwargs in entry.all_inputs(skip=("differentiable",)):
        world.seed_params()
        weight = Parameter(torch.randn((10, 5)))
        weight_c = weight.detach().clone().requires_grad_(True)
        bias = Parameter(torch.randn(10))
        bias_c = bias.detach().clone().requires_grad_(True)
        world.seed_data()
        inpt = torch.randn(5)
        kwargs.pop("lr", None)
        kwargs["lr"] = 1e-3
        optimizer_r = build(entry, [weight, bias], kwargs)
        if optimizer_r is None:
            continue
        try:
            kwargs["lr"] = torch.tensor(kwargs["lr"])
            optimizer = entry.make([weight_c, bias_c], **kwargs)
        except ValueError as e:
            assert re.search(".*lr as a Tensor is not supported.*", str(e)), str(e)
            continue

        def closure(optim, w, b, i):
            optim.zero_grad()
            loss = (w.mv(i) + b).pow(2).sum()
            loss.backward()
            return loss

        for _ in range(5):
            closure(optimizer_r, weight, bias, inpt)
            closure(optimizer, weight_c, bias_c, inpt)
            optimizer_r.step()
            optimizer.step()
            assert_same(weight, weight_c)
            assert_same(bias, bias_c)


def test_complex(entry: Entry, world: World) -> None:
    dtype = torch.complex64
    for kwargs in entry.all_inputs(skip=("differentiable", "fused")):
        world.seed_params()
        complex_params = [
            torch.randn(10, 5, dtype=dtype, requires_grad=True),
            torch.randn(10, dtype=dtype, requires_grad=True),
            torch.randn(10, 5, dtype=torch.float32, requires_grad=True),
        ]
        real_params = [
            (
                torch.view_as_real(p).detach().clone().requires_grad_()
                if p.is_complex()
                else p.detach().clone().requires_grad_()
            )
            for p in complex_params
        ]
        real_optimizer = build(entry, real_params, kwargs)
        if real_optimizer is None:
            continue
        if entry.refuses_dtype(dtype):
            try:
                entry.make(complex_params, **kwargs)
            except TypeError as e:
                assert "does not support complex parameters" in str(e)
                continue
            raise AssertionError(f"{entry} accepted complex parameters")
        complex_optimizer = entry.make(complex_params, **kwargs)
        real_steps, complex_steps, grads_losses = [], [], []

        def real_closure():
            for param in real_params:
                grad = torch.randn_like(param)
                param.grad = grad
                real_steps.append(param.detach().clone())
                grads_losses.append(grad.clone())
            loss = torch.randn(1)
            grads_losses.append(loss.clone())
            return loss

        def complex_closure():
            for param in complex_params:
                if torch.is_complex(param):
                    grad = torch.view_as_complex(grads_losses.pop(0))
                    complex_steps.append(torch.view_as_real_copy(param.detach()))
                else:
                    grad = grads_losses.pop(0)
                    complex_steps.append(param.detach().clone())
                param.grad = grad
            return grads_losses.pop(0)

        for _ in range(3):
            real_closure()
            complex_closure()
            real_optimizer.step()
            complex_optimizer.step()
        as_real = [torch.view_as_real(p) if p.is_complex() else p for p in complex_params]
        for a, b in zip(real_params, as_real, strict=True):
            torch.testing.assert_close(a, b)
        for a, b in zip(complex_steps, real_steps, strict=True):
            torch.testing.assert_close(a, b)


def _compare_between(
    inputs: Any, models: list[Any], optimizers: list[Optimizer], **tol: float
) -> None:
    """7 iterations of both, a layer frozen at 3 and unfrozen at 5, no gradient at all at 2;
    after each, parameters and every state entry equal."""
    for i in range(7):
        for inpt, model, optimizer in zip([inputs, inputs], models, optimizers, strict=True):
            optimizer.zero_grad()
            if i == 3:
                model[2].requires_grad_(False)
            if i == 5:
                model[2].requires_grad_(True)
            if i != 2:
                model(inpt).sum().backward()
            optimizer.step()
        og_state, new_state = optimizers[0].state, optimizers[1].state
        for og_p, new_p in zip(models[0].parameters(), models[1].parameters(), strict=True):
            assert_same(og_p, new_p, f"iteration {i}", **tol)
            for k in og_state[og_p]:
                assert_same(og_state[og_p][k], new_state[new_p][k], f"iteration {i} {k}", **tol)


def _test_derived_optimizers(
    entry: Entry, world: World, flag: str, dtype: torch.dtype, **tol: float
) -> None:
    for kwargs in entry.optim_inputs():
        kwargs = deepcopy(kwargs)
        if dtype == torch.float16:
            kwargs["eps"] = 0.1  # optim_inputs_func_adam's: 1e-8 rounds to 0 in float16
        models, optimizers = [], []
        for flag_value in (False, True):
            kwargs[flag] = flag_value
            world.seed_data()
            inpt = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=dtype).reshape(3, 2)
            torch.manual_seed(1)
            model = torch.nn.Sequential(
                torch.nn.Linear(2, 3),
                torch.nn.Sigmoid(),
                torch.nn.Linear(3, 1),
                torch.nn.Sigmoid(),
            ).to(dtype)
            # torch's test leaves this 0-d parameter uninitialized; a NaN found there by chance
            # is a non-finite pseudo-gradient to DiLoCo (NonFiniteError), so it gets a value
            empty_param = torch.rand((), dtype=dtype).requires_grad_()
            empty_param.grad = torch.rand_like(empty_param)
            params = [*model.parameters(), empty_param]
            optimizer = build(entry, params, kwargs)
            if optimizer is None:
                break
            models.append(model)
            optimizers.append(optimizer)
        if len(optimizers) == 2:
            _compare_between(inpt, models, optimizers, **tol)


def test_foreach_matches_forloop(entry: Entry, world: World) -> None:
    # torch runs it in float64; commopt refuses float64 parameters (fp32 state and exchange),
    # so its rows run in float32, and the float64 refusal is checked
    dtype = torch.float32 if entry.refuses_dtype(torch.float64) else torch.float64
    if entry.refuses_dtype(torch.float64):
        try:
            entry.make([Parameter(torch.randn(3, dtype=torch.float64))])
        except TypeError as e:
            assert "float64" in str(e)
        else:
            raise AssertionError(f"{entry} accepted a float64 parameter")
    _test_derived_optimizers(entry, world, "foreach", dtype)


def test_fused_matches_forloop(entry: Entry, world: World) -> None:
    if "fused" not in entry.supported_impls:
        assert build(entry, [Parameter(torch.randn(3))], {"fused": True}) is None
        return
    for dtype in (torch.float64, torch.float32):
        if not entry.refuses_dtype(dtype):  # (test_foreach_matches_forloop checks the refusal)
            _test_derived_optimizers(entry, world, "fused", dtype)
    for dtype in (torch.bfloat16, torch.float16):  # Adam's toleranceOverride for these
        _test_derived_optimizers(entry, world, "fused", dtype, atol=5e-3, rtol=5e-3)


def test_param_groups_weight_decay(entry: Entry, world: World) -> None:
    for kwargs in entry.all_inputs(skip=("differentiable",)):
        bias_kwargs = deepcopy(kwargs)
        bias_kwargs["weight_decay"] = 0.0
        world.seed_params()
        weight = Parameter(torch.randn((10, 5)))
        bias = Parameter(torch.randn(10))
        world.seed_data()
        inpt = torch.randn(5)
        if entry.refusal(kwargs) is not None:
            assert build(entry, [weight], kwargs) is None
            continue
        optimizer = entry.make(
            [dict(params=[weight], **kwargs), dict(params=[bias], **bias_kwargs)]
        )
        loss = (weight.mv(inpt) + bias).pow(2).sum()
        initial_value = world.mean(loss.item())
        for _ in range(20):
            optimizer.zero_grad()
            loss = (weight.mv(inpt) + bias).pow(2).sum()
            loss.backward()
            optimizer.step()
        world.agree(entry, optimizer, [weight, bias])
        if kwargs.get("maximize", False):
            assert world.mean(loss.item()) > initial_value
        else:
            assert world.mean(loss.item()) < initial_value


def test_param_groups_lr(entry: Entry, world: World) -> None:
    for kwargs in entry.all_inputs(skip=("differentiable",)):
        if "lr" not in kwargs or kwargs["lr"] == 0:
            kwargs["lr"] = 1e-3
        world.seed_params()
        weight = Parameter(torch.randn((10, 5)))
        bias = Parameter(torch.randn(10))
        irrelevant = Parameter(torch.randn(2))
        irrelevant_clone = irrelevant.clone()
        world.seed_data()
        inpt = torch.randn(5)
        if entry.refusal(kwargs) is not None:
            assert build(entry, [weight], kwargs) is None
            continue
        optimizer = entry.make(
            [dict(params=[weight, bias], **kwargs), dict(params=[irrelevant])], lr=1e-28
        )
        loss = (weight.mv(inpt) + bias).pow(2).sum()
        initial_value = world.mean(loss.item())
        for _ in range(20):
            optimizer.zero_grad()
            loss = (weight.mv(inpt) + bias).pow(2).sum()
            loss.backward()
            irrelevant.grad = torch.rand_like(irrelevant)
            optimizer.step()
        world.agree(entry, optimizer, [weight, bias, irrelevant])
        if kwargs.get("maximize", False):
            assert world.mean(loss.item()) > initial_value
        else:
            assert world.mean(loss.item()) < initial_value
        # torch's assertEqual: float32 tolerance (atol 1e-5); a step of lr 1e-28 is far below
        torch.testing.assert_close(irrelevant, irrelevant_clone)


def test_step_is_noop_when_params_have_no_grad(entry: Entry, world: World) -> None:
    params = [torch.randn(2, 3, requires_grad=False) for _ in range(2)]
    old_params = [p.detach().clone() for p in params]
    for kwargs in entry.all_inputs():
        optimizer = build(entry, params, kwargs)
        if optimizer is None:
            continue
        optimizer.step(lambda: torch.tensor([1.0]))
        assert_same(params, old_params)


def test_step_is_noop_for_zero_grads(entry: Entry, world: World) -> None:
    param = torch.randn((5, 1), requires_grad=True)
    old_param = param.detach().clone()
    for kwargs in entry.all_inputs():
        if kwargs.get("weight_decay", 0) != 0:
            continue
        params = [param.clone()] if kwargs.get("differentiable", False) else [param]
        optimizer = build(entry, params, kwargs)
        if optimizer is None:
            continue
        params[0].grad = torch.zeros_like(params[0])
        optimizer.step(lambda: torch.tensor([1.0]))
        assert_same(old_param, params[0].detach())


def test_optimizer_can_be_printed(entry: Entry, world: World) -> None:
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    for kwargs in entry.all_inputs():
        optimizer = build(entry, params, kwargs)
        if optimizer is not None:
            assert type(optimizer).__name__ in repr(optimizer)


def _without_param_names(state_dict: dict[str, Any]) -> dict[str, Any]:
    new_state_dict = deepcopy(state_dict)
    for pg in new_state_dict["param_groups"]:
        pg.pop("param_names", None)
    return new_state_dict


def _named(params: list[Any], is_named: bool) -> list[Any]:
    return [(f"name{i}", p) for i, p in enumerate(params)] if is_named else params


def _small_linear(world: World) -> tuple[Parameter, Parameter, torch.Tensor]:
    """The (2, 3) weight, bias and input of the state-dict tests."""
    world.seed_params()
    weight = Parameter(torch.randn(2, 3))
    bias = Parameter(torch.randn(2))
    world.seed_data()
    return weight, bias, torch.randn(3, requires_grad=True)


def _fwd_bwd_linear(optim: Optimizer, w: torch.Tensor, b: torch.Tensor, i: torch.Tensor):
    optim.zero_grad()
    loss = (w.mv(i) + b).pow(2).sum()
    loss.backward()
    return loss


def test_state_dict_deterministic(
    entry: Entry, world: World, is_named_optim0: bool, is_named_optim1: bool
) -> None:
    weight, bias, inpt = _small_linear(world)
    fwd_bwd = _fwd_bwd_linear

    for kwargs in entry.all_inputs(skip=("differentiable",)):
        optimizer = build(entry, _named([weight, bias], is_named_optim0), kwargs)
        if optimizer is None:
            continue
        closure = functools.partial(fwd_bwd, optimizer, weight, bias, inpt)
        for _ in range(10):
            closure()
            optimizer.step()
        with torch.no_grad():
            weight_c = Parameter(weight.clone())
            bias_c = Parameter(bias.clone())
        optimizer_c = entry.make(_named([weight_c, bias_c], is_named_optim1), **kwargs)
        closure_c = functools.partial(fwd_bwd, optimizer_c, weight_c, bias_c, inpt)
        optimizer_c.load_state_dict(deepcopy(optimizer.state_dict()))
        for _ in range(10):
            closure()
            closure_c()
            optimizer.step()
            optimizer_c.step()
            # commopt promises a bit-exact resume; torch asserts within tolerance
            assert_same(weight, weight_c, exact=entry.commopt)
            assert_same(bias, bias_c, exact=entry.commopt)
        world.agree(entry, optimizer_c, [weight_c, bias_c])
        assert_same(
            _without_param_names(optimizer.state_dict()),
            _without_param_names(optimizer_c.state_dict()),
            exact=entry.commopt,
        )
        # repeated parameters have identical representation (pytorch#36831)
        optimizer_c.param_groups.extend(optimizer_c.param_groups)
        assert_same(
            _without_param_names(optimizer.state_dict())["param_groups"][-1],
            _without_param_names(optimizer_c.state_dict())["param_groups"][-1],
        )


def _conv_bn() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(4, 2, 1, stride=2), torch.nn.BatchNorm2d(2, eps=1e-05, momentum=0.1)
    )
    return model, torch.rand(1, 4, 16, 16)


def _fwd_bwd(optim: Optimizer, mod: torch.nn.Module, i: torch.Tensor) -> torch.Tensor:
    optim.zero_grad()
    loss = mod(i).sum()
    loss.backward()
    return loss


def test_can_load_older_state_dict(entry: Entry, world: World) -> None:
    for kwargs in entry.all_inputs(skip=("differentiable",)):
        model, inpt = _conv_bn()
        optimizer = build(entry, model.parameters(), kwargs)
        if optimizer is None:
            continue
        for _ in range(3):
            _fwd_bwd(optimizer, model, inpt)
            optimizer.step()
        old_state_dict = deepcopy(optimizer.state_dict())
        for group in old_state_dict["param_groups"]:
            for flag in NOT_OG_SUPPORTED_FLAGS:
                group.pop(flag, None)
        optimizer.load_state_dict(old_state_dict)
        _fwd_bwd(optimizer, model, inpt)
        optimizer.step()


def test_can_load_from_to_named_state_dict(
    entry: Entry, world: World, is_named_optim0: bool, is_named_optim1: bool
) -> None:
    for kwargs in entry.all_inputs(skip=("differentiable",)):
        model, inpt = _conv_bn()
        params = model.named_parameters() if is_named_optim0 else model.parameters()
        optimizer = build(entry, params, kwargs)
        if optimizer is None:
            continue
        for _ in range(3):
            _fwd_bwd(optimizer, model, inpt)
            optimizer.step()
        old_state_dict = deepcopy(optimizer.state_dict())
        params2 = model.named_parameters() if is_named_optim1 else model.parameters()
        optimizer2 = entry.make(params2, **kwargs)
        optimizer2.load_state_dict(old_state_dict)
        _fwd_bwd(optimizer2, model, inpt)
        optimizer2.step()
        if is_named_optim0 or is_named_optim1:
            names = optimizer2.state_dict()["param_groups"][0]["param_names"]
            assert names == ["0.weight", "0.bias", "1.weight", "1.bias"]


def test_save_load_equality_with_weights_only(
    entry: Entry, world: World, is_named_optim: bool
) -> None:
    weight, bias, inpt = _small_linear(world)
    fwd_bwd = _fwd_bwd_linear

    for kwargs in entry.all_inputs(skip=("differentiable",)):
        optimizer = build(entry, _named([weight, bias], is_named_optim), kwargs)
        if optimizer is None:
            continue
        closure = functools.partial(fwd_bwd, optimizer, weight, bias, inpt)
        for _ in range(3):
            optimizer.step(closure)
        sd = optimizer.state_dict()
        f = io.BytesIO()
        torch.save(sd, f)
        f.seek(0)
        assert_same(torch.load(f), sd)
        f.seek(0)
        assert_same(torch.load(f, weights_only=True), sd)


def test_load_nontensor_step(entry: Entry, world: World) -> None:
    world.seed_params()
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    world.seed_data()
    for p in params:
        p.grad = torch.rand_like(p)
    for kwargs in entry.all_inputs(skip=("differentiable",)):
        optimizer = build(entry, params, kwargs)
        if optimizer is None:
            continue
        for _ in range(3):
            optimizer.step()
        state_dict = deepcopy(optimizer.state_dict())
        for p_state in state_dict["state"].values():
            if "step" in p_state and torch.is_tensor(p_state["step"]):
                p_state["step"] = p_state["step"].item()
        optimizer.load_state_dict(state_dict)
        optimizer.step()


def _state_dict_pre_hook(optimizer: Optimizer) -> None:
    optimizer.state["test"] = 1


def _state_dict_post_hook(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    if "test" in state_dict["state"]:
        state_dict["state"].pop("test")
        state_dict["ran_state_dict_pre_hook"] = True
    else:
        state_dict["ran_state_dict_pre_hook"] = False
    return state_dict


def _hook_optimizers(entry: Entry) -> list[Optimizer]:
    out = []
    for kwargs in entry.all_inputs():
        optimizer = build(entry, [torch.rand(2, 3, requires_grad=True)], kwargs)
        if optimizer is not None:
            out.append(optimizer)
    return out


def test_state_dict_pre_hook(entry: Entry, world: World) -> None:
    for optim in _hook_optimizers(entry):
        optim.register_state_dict_pre_hook(_state_dict_pre_hook)
        assert optim.state_dict()["state"]["test"] == 1


def test_state_dict_post_hook(entry: Entry, world: World) -> None:
    for optim in _hook_optimizers(entry):
        optim.register_state_dict_post_hook(_state_dict_post_hook)
        assert optim.state_dict()["ran_state_dict_pre_hook"] is False


def test_state_dict_pre_post_hook(entry: Entry, world: World) -> None:
    for optim in _hook_optimizers(entry):
        optim.register_state_dict_pre_hook(_state_dict_pre_hook)
        optim.register_state_dict_post_hook(_state_dict_post_hook)
        state_dict = optim.state_dict()
        assert "test" not in state_dict["state"]
        assert state_dict["ran_state_dict_pre_hook"] is True


def _load_state_dict_pre_hook1(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    state_dict["param_groups"][0]["lr"] = 0.002


def _load_state_dict_pre_hook2(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict:
    my_state_dict = deepcopy(state_dict)
    my_state_dict["param_groups"][0]["lr"] = 0.003
    return my_state_dict


def _load_state_dict_post_hook(optimizer: Optimizer) -> None:
    optimizer.state["ran_load_state_dict_pre_hook2"] = optimizer.param_groups[0]["lr"] == 0.003
    optimizer.state["ran_load_state_dict_post_hook"] = True


def test_load_state_dict_pre_hook_and_prepend(entry: Entry, world: World) -> None:
    for optim in _hook_optimizers(entry):
        state_dict = optim.state_dict()
        optim.register_load_state_dict_pre_hook(_load_state_dict_pre_hook1)
        optim.load_state_dict(state_dict)
        assert optim.param_groups[0]["lr"] == 0.002
        optim.register_load_state_dict_pre_hook(_load_state_dict_pre_hook2, prepend=True)
        optim.load_state_dict(state_dict)
        assert optim.param_groups[0]["lr"] == 0.002  # prepended: the other hook overrides


def test_load_state_dict_post_hook(entry: Entry, world: World) -> None:
    for optim in _hook_optimizers(entry):
        optim.register_load_state_dict_post_hook(_load_state_dict_post_hook)
        optim.load_state_dict(optim.state_dict())
        assert optim.state["ran_load_state_dict_pre_hook2"] is False
        assert optim.state["ran_load_state_dict_post_hook"] is True


def test_load_state_dict_pre_post_hook(entry: Entry, world: World) -> None:
    for optim in _hook_optimizers(entry):
        optim.register_load_state_dict_pre_hook(_load_state_dict_pre_hook2)
        optim.register_load_state_dict_post_hook(_load_state_dict_post_hook)
        optim.load_state_dict(optim.state_dict())
        assert optim.state["ran_load_state_dict_pre_hook2"] is True
        assert optim.state["ran_load_state_dict_post_hook"] is True


def _step_hook_optimizers(entry: Entry) -> list[Optimizer]:
    out = []
    for kwargs in entry.all_inputs():
        optimizer = build(entry, [torch.tensor([1.0, 1.0])], kwargs)
        if optimizer is not None:
            out.append(optimizer)
    return out


def _check_step_hook(entry: Entry, register: str, start: int) -> None:
    """torch's step pre/post hook tests: +2 per step while registered, nothing after removal."""
    for optim in _step_hook_optimizers(entry):
        data = [start]
        handle = getattr(optim, register)(lambda o, a, k: data.append(data.pop() + 2))
        optim.step()
        optim.step()
        assert data == [start + 4]
        handle.remove()
        optim.step()
        assert data == [start + 4]


def test_step_post_hook(entry: Entry, world: World) -> None:
    _check_step_hook(entry, "register_step_post_hook", 2)


def test_step_pre_hook(entry: Entry, world: World) -> None:
    _check_step_hook(entry, "register_step_pre_hook", 5)


def test_step_all_hooks(entry: Entry, world: World) -> None:
    params = [torch.tensor([1.0, 1.0])]
    for kwargs in entry.all_inputs():
        optim = build(entry, params, kwargs)
        if optim is None:
            continue
        optim2 = SGD(params)
        data: list[int] = []
        handles = [
            register_optimizer_step_pre_hook(lambda o, a, k: data.append(0)),
            register_optimizer_step_post_hook(lambda o, a, k: data.append(5)),
            optim.register_step_pre_hook(lambda o, a, k: data.append(1)),
            optim.register_step_post_hook(lambda o, a, k: data.append(2)),
            optim2.register_step_pre_hook(lambda o, a, k: data.append(1)),
            optim2.register_step_post_hook(lambda o, a, k: data.append(2)),
        ]
        try:
            optim.step()
            assert data == [0, 1, 2, 5]
            optim2.step()
            assert data == [0, 1, 2, 5, 0, 1, 2, 5]
            optim.step()
            assert data == [0, 1, 2, 5, 0, 1, 2, 5, 0, 1, 2, 5]
        finally:
            for handle in handles:
                handle.remove()
        optim.step()
        optim2.step()
        assert data == [0, 1, 2, 5, 0, 1, 2, 5, 0, 1, 2, 5]


def test_deepcopy_copies_all_public_attrs(entry: Entry, world: World) -> None:
    world.seed_params()
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    world.seed_data()
    for p in params:
        p.grad = torch.rand_like(p)

    def public(obj):
        return {k for k in obj.__dict__ if not k.startswith("_")}

    for kwargs in entry.all_inputs(skip=("differentiable",)):
        optimizer = build(entry, params, kwargs)
        if optimizer is None:
            continue
        for _ in range(3):
            optimizer.step()
        if not entry.deep_copies:
            try:
                deepcopy(optimizer)
            except TypeError as e:
                assert "save opt.state_dict()" in str(e), e
                continue
            raise AssertionError(f"{entry} was deep-copied")
        assert public(optimizer) == public(deepcopy(optimizer))


def test_non_empty_state(entry: Entry, world: World) -> None:
    world.seed_params()
    model = torch.nn.Linear(5, 5)
    world.seed_data()
    inpt = torch.rand(2, 5)
    for kwargs in entry.optim_inputs():
        optim = build(entry, model.parameters(), kwargs)
        if optim is None:
            continue
        optim.zero_grad()
        model(inpt).sum().backward()
        optim.step()
        for state in optim.state.values():
            assert len(state) > 0


#: every ported body, with its own parameters (pytest.mark.parametrize arguments)
BODIES: dict[str, tuple[Callable[..., None], dict[str, list[Any]]]] = {
    f.__name__: (f, params)
    for f, params in [
        (test_optim_infos_do_not_specify_global_cliquey_kwargs, {}),
        (test_errors, {}),
        (
            test_forloop_goes_right_direction,
            {"contiguous": [True, False], "with_lrsched": [True, False]},
        ),
        (test_param_group_with_lrscheduler_goes_right_direction, {}),
        (test_tensor_lr, {}),
        (test_complex, {}),
        (test_foreach_matches_forloop, {}),
        (test_fused_matches_forloop, {}),
        (test_param_groups_weight_decay, {}),
        (test_param_groups_lr, {}),
        (test_step_is_noop_when_params_have_no_grad, {}),
        (test_step_is_noop_for_zero_grads, {}),
        (test_optimizer_can_be_printed, {}),
        (
            test_state_dict_deterministic,
            {"is_named_optim0": [True, False], "is_named_optim1": [True, False]},
        ),
        (test_can_load_older_state_dict, {}),
        (
            test_can_load_from_to_named_state_dict,
            {"is_named_optim0": [True, False], "is_named_optim1": [True, False]},
        ),
        (test_save_load_equality_with_weights_only, {"is_named_optim": [True, False]}),
        (test_load_nontensor_step, {}),
        (test_state_dict_pre_hook, {}),
        (test_state_dict_post_hook, {}),
        (test_state_dict_pre_post_hook, {}),
        (test_load_state_dict_pre_hook_and_prepend, {}),
        (test_load_state_dict_post_hook, {}),
        (test_load_state_dict_pre_post_hook, {}),
        (test_step_post_hook, {}),
        (test_step_pre_hook, {}),
        (test_step_all_hooks, {}),
        (test_deepcopy_copies_all_public_attrs, {}),
        (test_non_empty_state, {}),
    ]
}


def cases() -> list[tuple[str, dict[str, Any]]]:
    """(body name, its keyword arguments) for every combination of its parameters."""
    import itertools

    out = []
    for name, (_, params) in BODIES.items():
        keys = list(params)
        for values in itertools.product(*(params[k] for k in keys)):
            out.append((name, dict(zip(keys, values, strict=True))))
    return out


def run(body: str, entry_name: str, world: World = ONE_PROCESS, **kwargs: Any) -> None:
    """Run one ported body on one entry (the bodies assert)."""
    entry = next(e for e in ENTRIES if e.name == entry_name)
    BODIES[body][0](entry, world, **kwargs)
