"""Generic checks every commopt optimizer must pass, in one process, driven by the registry in
``tests/optim_registry.py`` (OnebitAdam, OnebitLamb, ZeroOneAdam alike; "every phase" is each
one's schedule as the SPEC defines it).

Only public API: constructors, ``step``, ``param_groups``, ``state[p]``, ``global_state``,
``state_dict``/``load_state_dict``, ``add_param_group``, ``comm_stats``. The algorithm-specific
numerics (references, schedules, σ, …) stay in the per-optimizer files.
"""

from __future__ import annotations

import ast
import pathlib
import warnings

import pytest
import torch

import commopt
from tests.optim_registry import (
    BY_NAME,
    IN,
    OPTIMIZERS,
    OptimizerInfo,
    Phase,
    batch,
    first_layer_mask,
    loss_of,
    make_groups,
    make_model,
    outside,
    reload,
    snapshot,
    snapshot_diff,
    state_dict_diff,
    train_step,
)

# Warnings that are part of the runs below and not what these tests look at.
pytestmark = pytest.mark.filterwarnings("ignore:.*elements have zero variance")

PHASES = [(info, phase) for info in OPTIMIZERS for phase in info.phases()]
PHASE_IDS = [f"{info.name}-{phase.name}" for info, phase in PHASES]
ERRORS = [(info, case) for info in OPTIMIZERS for case in info.error_inputs]
ERROR_IDS = [f"{info.name}-{case.id}" for info, case in ERRORS]
RESUMES = [(info, k) for info in OPTIMIZERS for k in info.resume_points()]
RESUME_IDS = [f"{info.name}-after{k}-{info.phase_of(k).name}" for info, k in RESUMES]
LOW = [torch.bfloat16, torch.float16]


def make(info: OptimizerInfo, params, **overrides):
    """The optimizer in a world of one process, whatever default backend another test set."""
    return info.make(params, **{"backend": commopt.SingleProcessBackend(), **overrides})


def build(info: OptimizerInfo, seed: int = 0, dtype=torch.float32, mask=None, **overrides):
    model = make_model(seed, dtype)
    return model, make(info, make_groups(model, mask), **overrides)


def run(model, opt, steps, rank: int = 0) -> None:
    for t in steps:
        train_step(model, opt, rank, t)


# -- arguments ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("info", "case"), ERRORS, ids=ERROR_IDS)
def test_invalid_arguments_are_rejected(info: OptimizerInfo, case) -> None:
    with pytest.raises(case.error, match=case.match):
        make(info, case.build_params(), **case.kwargs)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=str)
def test_mask_that_broadcasts_is_accepted_and_add_param_group_checks_it(info) -> None:
    w = torch.nn.Parameter(torch.zeros(3, 4))
    opt = make(info, [{"params": [w], "exp_avg_mask": torch.ones(4)}])  # broadcasts: fine
    with pytest.raises(ValueError, match=r"exp_avg_mask of shape \(2,\) does not broadcast"):
        opt.add_param_group(
            {"params": [torch.nn.Parameter(torch.zeros(3))], "exp_avg_mask": torch.ones(2)}
        )


# -- sparse gradients -----------------------------------------------------------------------------
SPARSE_MESSAGE = r"does not support sparse gradients .*sparse=False"


@pytest.mark.parametrize("info", OPTIMIZERS, ids=str)
def test_sparse_embedding_gradient_is_rejected(info) -> None:
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = make(info, emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match=rf"{info.name} {SPARSE_MESSAGE}"):
        opt.step()


@pytest.mark.parametrize(("info", "phase"), PHASES, ids=PHASE_IDS)
def test_sparse_gradient_is_rejected_in_every_phase_changing_nothing(info, phase: Phase) -> None:
    model, opt = build(info)
    run(model, opt, range(1, phase.first))
    params = list(model.parameters())
    before = snapshot(params, opt)
    opt.zero_grad()
    loss_of(model, 0, phase.first).backward()
    params[2].grad = params[2].grad.to_sparse()
    with pytest.raises(RuntimeError, match=SPARSE_MESSAGE):
        opt.step()
    # (at step 1 the state may be created, lazily as torch's, before the check)
    assert snapshot_diff(before, snapshot(params, opt), allow_new=True) == []


# -- non-finite gradients -------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize(("info", "phase"), PHASES, ids=PHASE_IDS)
def test_non_finite_gradient_skips_the_step_in_every_phase(info, phase: Phase, bad) -> None:
    k = phase.first
    model, opt = build(info, seed=1)
    twin, twin_opt = build(info, seed=1)  # never sees the bad gradient
    run(model, opt, range(1, k))
    run(twin, twin_opt, range(1, k))
    params = list(model.parameters())
    before, sd_before = snapshot(params, opt), reload(opt.state_dict())
    opt.zero_grad()
    loss_of(model, 0, k).backward()
    params[1].grad[2] = bad
    what = "the step is skipped on every rank" if phase.communicates else "update is dropped"
    with pytest.warns(
        UserWarning, match=rf"{info.name}: non-finite gradient .* step {k}\b.*{what}"
    ):
        opt.step()
    after = snapshot(params, opt)
    # Parameters and every state tensor are bit for bit what they were.
    assert snapshot_diff(before, after, skip=("global_state",), allow_new=True) == []
    gs_before, gs_after = before["global_state"], after["global_state"]
    assert gs_after["skipped_steps"] == gs_before["skipped_steps"] + 1
    assert opt.comm_stats()["skipped_steps"] == 1
    changed = {key for key in gs_after if gs_after[key] != gs_before.get(key)}
    if phase.communicates:  # the step did not happen at all
        assert changed == {"skipped_steps"}
    else:  # a local step: this rank's update is dropped, the shared schedule moves on
        assert gs_after["step"] == k and "skipped_steps" in changed
    if k > 1:  # …and the saved state differs only in those counters (at step 1 it is created)
        assert outside(state_dict_diff(sd_before, opt.state_dict()), changed) == []

    if phase.communicates:  # the run goes on exactly as if the bad batch had never come
        for t in range(k, info.steps + 1):
            train_step(model, opt, 0, t)
            train_step(twin, twin_opt, 0, t)
            diff = snapshot_diff(snapshot(params, opt), snapshot(list(twin.parameters()), twin_opt))
            assert diff == ["global_state"], (t, diff)  # only skipped_steps differs
    else:
        run(model, opt, range(k + 1, info.steps + 1))
        assert opt.global_state["step"] == info.steps
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


# -- closure --------------------------------------------------------------------------------------
@pytest.mark.parametrize("info", OPTIMIZERS, ids=str)
def test_closure_returns_the_loss_and_runs_with_grad_enabled(info) -> None:
    model, opt = build(info, seed=2)
    twin, twin_opt = build(info, seed=2)
    seen = []
    for t in range(1, info.steps + 1):
        losses = []

        def closure(t=t, losses=losses):
            seen.append(torch.is_grad_enabled())
            opt.zero_grad()
            loss = loss_of(model, 0, t)
            loss.backward()  # fails if the closure ran without grad
            losses.append(loss)
            return loss

        with torch.no_grad():  # as a training loop inside no_grad would call it
            returned = opt.step(closure)
        assert returned is losses[0], t
        train_step(twin, twin_opt, 0, t)  # the same step without a closure
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(p, q), t
    assert seen == [True] * info.steps
    assert opt.step() is None  # no closure: step() returns None (gradients of the last batch)


# -- exp_avg_mask ---------------------------------------------------------------------------------
@pytest.mark.parametrize("info", OPTIMIZERS, ids=str)
def test_exp_avg_mask_keeps_masked_momentum_at_zero(info) -> None:
    # At n = 1 the compressed exchange is the identity, but the mask still applies to what it
    # returns; tests/multirank/common_bodies.py checks the same at n = 2.
    mask = first_layer_mask()
    model, opt = build(info, seed=3, mask=mask)
    w = model[0].weight
    masked_before_masking = None
    for t in range(1, info.steps + 1):
        train_step(model, opt, 0, t)
        m = opt.state[w]["exp_avg"]
        phase = info.phase_of(t)
        if phase.masks_momentum:
            assert torch.count_nonzero(m[mask == 0]) == 0, (t, phase.name)
            assert bool((m[mask == 1] != 0).all()), (t, phase.name)
        elif masked_before_masking is None:
            masked_before_masking = m[mask == 0].clone()
    assert masked_before_masking is not None and bool((masked_before_masking != 0).all()), (
        "the mask must not apply before the first compressed exchange"
    )


# -- low precision --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("info", OPTIMIZERS, ids=str)
def test_low_precision_parameters_run_the_fp32_algorithm_with_fp32_state(info, dtype) -> None:
    """bf16/fp16 parameters: the state is fp32 and the parameters are, at every step, the
    rounding of what the same optimizer does to fp32 parameters fed the same gradients."""
    model = make_model(4, dtype)
    ref = make_model(4)
    with torch.no_grad():
        for r, p in zip(ref.parameters(), model.parameters(), strict=True):
            r.copy_(p.float())  # the same (rounded) starting point
    opt, ref_opt = make(info, make_groups(model)), make(info, make_groups(ref))
    start = [p.detach().clone() for p in model.parameters()]
    for t in range(1, info.steps + 1):
        opt.zero_grad()
        loss_of(model, 0, t).backward()
        for r, p in zip(ref.parameters(), model.parameters(), strict=True):
            r.grad = p.grad.float()
        opt.step()
        ref_opt.step()
        for r, p in zip(ref.parameters(), model.parameters(), strict=True):
            assert p.dtype == dtype and p.grad.dtype == dtype
            assert torch.equal(p.detach(), r.detach().to(dtype)), t
            for key, value in ref_opt.state[r].items():
                assert opt.state[p][key].dtype == value.dtype == torch.float32, key
                assert torch.equal(opt.state[p][key], value), (t, key)
            for key, value in opt.state[p].items():
                if torch.is_tensor(value) and value.is_floating_point():
                    assert value.dtype == torch.float32, key
                    assert bool(torch.isfinite(value).all()), key
    assert all(not torch.equal(a, p) for a, p in zip(start, model.parameters(), strict=True))


# -- state_dict: lock-step resume -----------------------------------------------------------------
def lockstep(info, model, opt, model2, opt2, steps) -> None:
    """Step both runs on the same batches; after every step parameters, every state tensor and
    global_state are bit-identical, and at the end the whole state_dict."""
    params, params2 = list(model.parameters()), list(model2.parameters())
    for t in steps:
        train_step(model, opt, 0, t)
        train_step(model2, opt2, 0, t)
        assert snapshot_diff(snapshot(params, opt), snapshot(params2, opt2)) == [], t
    assert state_dict_diff(opt.state_dict(), opt2.state_dict()) == []


# fp16 parameters take the same fp32-master path as bf16 (test_low_precision_… covers both)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("info", "save_at"), RESUMES, ids=RESUME_IDS)
def test_state_dict_round_trip_and_lockstep_resume_in_every_phase(info, save_at, dtype) -> None:
    model, opt = build(info, seed=5, dtype=dtype)
    run(model, opt, range(1, save_at + 1))
    saved = reload({"model": model.state_dict(), "opt": opt.state_dict()})
    clone = make_model(seed=99, dtype=dtype)
    clone.load_state_dict(saved["model"])
    # Group hyperparameters come from the state_dict (torch's rule), not the constructor.
    opt2 = make(info, make_groups(clone), lr=0.5, weight_decay=0.3)
    opt2.load_state_dict(saved["opt"])
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt2.param_groups] == hyper
    assert opt2.global_state == opt.global_state
    assert (
        snapshot_diff(
            snapshot(list(model.parameters()), opt), snapshot(list(clone.parameters()), opt2)
        )
        == []
    )
    lockstep(info, model, opt, clone, opt2, range(save_at + 1, info.steps + 1))


VARIANTS = [(info, v) for info in OPTIMIZERS for v in info.variants]


@pytest.mark.parametrize(("info", "variant"), VARIANTS, ids=[i.name for i, _ in VARIANTS])
def test_other_hyperparameters_resume_in_every_phase(info, variant) -> None:
    for save_at in info.resume_points():
        model, opt = build(info, seed=12, **variant)
        run(model, opt, range(1, save_at + 1))
        saved = reload({"model": model.state_dict(), "opt": opt.state_dict()})
        clone = make_model(seed=98)
        clone.load_state_dict(saved["model"])
        opt2 = make(info, make_groups(clone), **variant)
        opt2.load_state_dict(saved["opt"])
        lockstep(info, model, opt, clone, opt2, range(save_at + 1, info.steps + 1))


@pytest.mark.parametrize("info", OPTIMIZERS, ids=str)
def test_state_layout_and_global_state(info) -> None:
    model, opt = build(info)
    assert opt.global_state["step"] == 0 and opt.global_state["skipped_steps"] == 0
    assert set(info.extra_global_keys) <= set(opt.global_state)
    for t in range(1, info.steps + 1):
        train_step(model, opt, 0, t)
        assert opt.global_state["step"] == t
        for p in model.parameters():
            for key in info.state_keys:
                value = opt.state[p][key]
                assert value.dtype == torch.float32, key
                assert value.shape == (p.shape if value.dim() else ()), key
    stats = opt.comm_stats()  # one process: nothing on the wire, not even a "round"
    assert stats["bytes_sent"] == 0 and stats["calls"] == 0 and stats["skipped_steps"] == 0
    assert stats["full_precision_rounds"] == 0 and stats["compressed_rounds"] == 0


# -- the zero-variance guard ----------------------------------------------------------------------
DEAD = 3  # an input feature that is always 0: its weight column never gets a gradient


@pytest.mark.parametrize("info", OPTIMIZERS, ids=str)
def test_dead_input_never_moves(info) -> None:
    model = make_model(6)
    w = model[0].weight
    start = w.detach().clone()
    groups = make_groups(model)
    groups[0]["weight_decay"] = 0.0  # weight decay alone would move it
    opt = make(info, groups)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(1, info.steps + 1):
            x, y = batch(0, t)
            x[:, DEAD] = 0.0
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            assert torch.equal(w[:, DEAD], start[:, DEAD]), t
            assert bool((opt.state[w]["exp_avg_sq"][:, DEAD] == 0).all())
            assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    live = [c for c in range(IN) if c != DEAD]
    assert bool((w[:, live] != start[:, live]).all())
    guard = [str(c.message) for c in caught if "zero variance" in str(c.message)]
    assert len(guard) == 1 and guard[0].startswith(f"{info.name}: {w.shape[0]} of "), guard


# -- empty groups and parameters with no elements -------------------------------------------------
@pytest.mark.parametrize("info", OPTIMIZERS, ids=str)
def test_empty_groups_are_allowed_and_change_nothing(info) -> None:
    # torch: an empty parameter list is an error (see the registry), an empty group is not.
    model, opt = build(info, seed=7)
    twin = make_model(7)
    g0, g1 = make_groups(twin)
    twin_opt = make(info, [g0, {"params": [], "lr": 0.5}, g1])
    only_empty = make(info, [{"params": []}])
    for t in range(1, info.steps + 1):
        train_step(model, opt, 0, t)
        train_step(twin, twin_opt, 0, t)
        only_empty.step()
        if t == 2:
            twin_opt.add_param_group({"params": []})
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(p, q), t
            assert torch.equal(opt.state[p]["exp_avg"], twin_opt.state[q]["exp_avg"]), t
    assert only_empty.global_state["step"] == info.steps
    assert only_empty.state_dict()["state"] == {}
    resumed = make(info, [{"params": []}])
    resumed.load_state_dict(reload(only_empty.state_dict()))
    resumed.step()
    assert resumed.global_state["step"] == info.steps + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("info", OPTIMIZERS, ids=str)
def test_zero_size_parameters_stay_finite_and_change_nothing(info, dtype) -> None:
    model, opt = build(info, seed=8, dtype=dtype)
    twin = make_model(8, dtype)
    empty = [torch.nn.Parameter(torch.zeros(0, 3, dtype=dtype)), torch.nn.Parameter(torch.zeros(0))]
    g0, g1 = make_groups(twin)
    g0["params"] = [empty[0], *g0["params"]]
    twin_opt = make(info, [g0, g1, {"params": [empty[1]]}])
    alone = torch.nn.Parameter(torch.zeros(0, 2, dtype=dtype))
    alone_opt = make(info, [alone])
    for t in range(1, info.steps + 1):
        train_step(model, opt, 0, t)
        train_step(twin, twin_opt, 0, t)
        alone.grad = torch.zeros(0, 2, dtype=dtype)
        alone_opt.step()
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(p, q), t
            for key, value in opt.state[p].items():
                assert torch.equal(value, twin_opt.state[q][key]), (t, key)
    for p in empty:  # never a gradient: no state, as in torch.optim
        assert p.numel() == 0 and not twin_opt.state.get(p)
    for key in info.state_keys:
        value = alone_opt.state[alone][key]
        assert value.shape == (alone.shape if value.dim() else ()), key
        assert bool(torch.isfinite(value).all()), key
    # a checkpoint with them round-trips
    resumed_model = make_model(9, dtype)
    resumed_model.load_state_dict(twin.state_dict())
    empty2 = [
        torch.nn.Parameter(torch.zeros(0, 3, dtype=dtype)),
        torch.nn.Parameter(torch.zeros(0)),
    ]
    r0, r1 = make_groups(resumed_model)
    r0["params"] = [empty2[0], *r0["params"]]
    resumed = make(info, [r0, r1, {"params": [empty2[1]]}])
    resumed.load_state_dict(reload(twin_opt.state_dict()))
    t = info.steps + 1
    train_step(twin, twin_opt, 0, t)
    train_step(resumed_model, resumed, 0, t)
    for p, q in zip(twin.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert (
        snapshot_diff(
            snapshot([*empty, *twin.parameters()], twin_opt),
            snapshot([*empty2, *resumed_model.parameters()], resumed),
        )
        == []
    )


# -- parameters without a gradient, and a normal run ----------------------------------------------
@pytest.mark.parametrize("info", OPTIMIZERS, ids=str)
def test_parameter_without_gradient_never_moves(info) -> None:
    """A parameter with no gradient (on every rank) is skipped entirely, as torch.optim skips
    ``grad is None``: it never moves and holds no state; the rest of the model trains exactly
    as without that parameter (docs/optimizers.md). (A *zero* gradient is a gradient: with it
    1-bit LAMB's bucket-wide scale counts the tensor, as DeepSpeed's does.)"""
    model, opt = build(info, seed=10)
    unused = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 7))
    opt.add_param_group({"params": [unused], "weight_decay": 0.0})
    model2, opt2 = build(info, seed=10)  # the same model, without that parameter
    start = unused.detach().clone()
    for t in range(1, info.steps + 1):
        for m, o in ((model, opt), (model2, opt2)):
            o.zero_grad()
            loss_of(m, 0, t).backward()
            o.step()
        assert unused.grad is None and torch.equal(unused, start), t
        assert not opt.state.get(unused), t  # never a gradient: no state, as in torch.optim
        a = snapshot([*model.parameters()], opt)
        b = snapshot([*model2.parameters()], opt2)
        assert snapshot_diff(a, b, skip=("global_state",)) == [], t
        # the schedules agree; only the note of which parameters never had a gradient differs
        # (and 0/1 Adam's per-group Σ η, which has one more group)
        gs_a, gs_b = a["global_state"], b["global_state"]
        differ = {k for k in gs_a.keys() | gs_b.keys() if gs_a.get(k) != gs_b.get(k)}
        assert differ <= {"untrained", "tracked", "lrs"}, t
        assert gs_a.get("lrs", [])[: len(gs_b.get("lrs", []))] == gs_b.get("lrs", []), t


@pytest.mark.parametrize("info", OPTIMIZERS, ids=str)
def test_a_normal_run_is_warning_free(info) -> None:
    model, opt = build(info, seed=11)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(model, opt, range(1, info.steps + 1))


def test_registry_covers_every_public_optimizer() -> None:
    public = {name for name in commopt.__all__ if isinstance(getattr(commopt, name), type)}
    optimizers = {n for n in public if issubclass(getattr(commopt, n), torch.optim.Optimizer)}
    # DiLoCo wraps another optimizer and has a matrix of its own (tests/diloco_matrix.py)
    assert {info.name for info in OPTIMIZERS} == optimizers - {"DiLoCo"}
    for info in OPTIMIZERS:
        phases = info.phases()
        steps = sorted(t for ph in phases for t in ph.steps)
        assert steps == list(range(1, info.steps + 1)), info.name  # a partition of the run
        assert all(ph.steps for ph in phases), info.name  # every phase occurs
        assert info.phase_of(info.steps).communicates  # the run ends with replicas in sync


#: test modules that may name several optimizers in one table, and why
OWN_TABLES = {
    "tests/multirank/test_lamb_zero_one_gloo.py": "resume controls derived by hand from SPEC §3/§4",
}


def _optimizer_named(node: ast.AST) -> str | None:
    """The optimizer a table entry names: "OnebitAdam", OnebitAdam, commopt.OnebitAdam, or a
    tuple that starts with one of these."""
    if isinstance(node, ast.Tuple) and node.elts:
        return _optimizer_named(node.elts[0])
    name = getattr(node, "value", None) if isinstance(node, ast.Constant) else None
    name = getattr(node, "id", None) if isinstance(node, ast.Name) else name
    name = getattr(node, "attr", None) if isinstance(node, ast.Attribute) else name
    return name if name in BY_NAME else None


def test_no_test_keeps_its_own_table_of_optimizers() -> None:
    """Tests that run several optimizers take them from the registry (``OPTIMIZERS``,
    ``BY_NAME``), so a new optimizer is covered everywhere: no list, tuple, set or dict literal
    outside ``tests/optim_registry.py`` names two of them."""
    root = pathlib.Path(__file__).resolve().parents[2]
    found = []
    for path in sorted((root / "tests").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "tests/optim_registry.py" or rel in OWN_TABLES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
                entries = node.elts
            elif isinstance(node, ast.Dict):
                entries = [k for k in node.keys if k is not None]
            else:
                continue
            if len({_optimizer_named(e) for e in entries} - {None}) >= 2:
                found.append(f"{rel}:{node.lineno}")
    assert found == [], f"tables of optimizers outside the registry: {found}"


@pytest.mark.parametrize("info", OPTIMIZERS, ids=str)
def test_a_state_dict_stripped_by_torchs_state_dict_api_is_refused_not_loaded(info) -> None:
    """torch.distributed.checkpoint.state_dict keeps only "state" and "param_groups" of an
    optimizer's state dict. Loading that used to restart the schedule (warmup, freeze, step
    count) under the moments of a later step, silently; now it is a clear error that changes
    nothing. A torch optimizer's state dict, which never had a "commopt" part, still loads."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model, opt = build(info)
    run(model, opt, range(1, info.steps + 1))
    stripped = get_optimizer_state_dict(model, opt)
    assert set(stripped) == {"state", "param_groups"}  # what torch's API keeps
    clone, fresh = build(info, seed=1)
    with pytest.raises(ValueError, match="has lost its 'commopt' part"):
        fresh.load_state_dict(opt.state_dict() | {"commopt": None})
    assert fresh.global_state["step"] == 0 and not fresh.state
    with pytest.raises(ValueError, match="get_optimizer_state_dict"):
        set_optimizer_state_dict(clone, fresh, stripped)
    adam = torch.optim.Adam(make_groups(model))
    train_step(model, adam, 0, 1)
    fresh.load_state_dict(adam.state_dict())
