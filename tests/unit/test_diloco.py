"""commopt.DiLoCo in one process: the errors a user gets for bad arguments, the fragments and
their schedule, the averages at n = 1, and a state dict that refuses what does not fit without
changing anything. (Several ranks: tests/multirank/test_diloco_gloo.py.)"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import commopt
from commopt.comm import SingleProcessBackend
from commopt.diloco.averages import Bf16Average, check_finite
from commopt.diloco.fragments import first_sync_offsets, split_parameters
from commopt.diloco.schedule import Settings


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _make(model=None, **kw):
    model = model or _model()
    inner = kw.pop("inner", None) or torch.optim.AdamW(model.parameters(), lr=1e-2)
    kw.setdefault("sync_every", 4)
    return model, commopt.DiLoCo(inner, backend=SingleProcessBackend(), **kw)


def _train(model, opt, steps) -> None:
    for step in steps:
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        ((model(x) - x[:, :2]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(compression="int8"), "Invalid compression: 'int8'"),
        (dict(sync_every=0), "Invalid sync_every: 0"),
        (dict(sync_every=True), "Invalid sync_every: True"),
        (dict(fragments=5), "fragments=5 needs sync_every >= fragments"),
        (dict(delay=4), "delay < sync_every // fragments = 4"),
        (dict(fragments=2, delay=2), "sync_every // fragments = 2"),
        (dict(delay=-1), "Invalid delay: -1"),
        (dict(warmup_steps=-3), "Invalid warmup_steps: -3"),
        (dict(fp32_syncs=-1), "Invalid fp32_syncs: -1"),
        (dict(fp32_syncs=2.0), "Invalid fp32_syncs: 2.0"),
        (dict(outer_lr=0.0), "Invalid outer_lr: 0.0"),
        (dict(outer_momentum=1.0), "Invalid outer_momentum: 1.0"),
        (dict(topology="ring"), "Invalid topology: 'ring'"),
    ],
)
def test_bad_arguments_are_refused_with_a_message_that_names_them(kw, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _make(**kw)


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(Settings)])
def test_a_setting_assigned_after_construction_is_refused_and_changes_nothing(name) -> None:
    """Every rank's schedule, the fragments' buffers and the agreement a checkpoint is checked
    against are built from the settings, so rebinding one would change the run in part only
    (``compression="none"`` over a 1-bit average, ``outer_momentum`` without its buffer, a
    ``sync_every`` the fragments' offsets never saw). As the optimizers' config fields, they are
    read-only."""
    model, opt = _make(sync_every=6, fragments=2, outer_momentum=0.5)
    before = opt.config
    value = getattr(opt, name)
    with pytest.raises(
        AttributeError, match=f"{name} is part of DiLoCo.config .frozen.: .*{name}="
    ):
        setattr(opt, name, value)
    assert opt.config is before and getattr(opt, name) == value
    assert getattr(opt.config, name) == value and f"{name}={value!r}" in repr(opt)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(opt.config, name, value)
    _train(model, opt, range(7))  # and it trains on
    assert opt.comm_stats()["syncs"] == 2  # each fragment once (offsets 0 and 3 of H = 6)


def test_the_inner_optimizer_must_be_a_torch_optimizer_over_real_fp32_or_lower() -> None:
    with pytest.raises(TypeError, match=r"inner must be a torch\.optim\.Optimizer"):
        commopt.DiLoCo(object(), sync_every=2)  # type: ignore[arg-type]
    for dtype, message in ((torch.complex64, "complex"), (torch.float64, "float64")):
        model = _model().to(dtype)
        with pytest.raises(TypeError, match=message):
            commopt.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)


def test_every_parameter_of_the_inner_optimizer_is_synced_frozen_or_not() -> None:
    """torch's optimizers take frozen parameters (a step leaves them as they are); DiLoCo syncs
    them too, so that one unfrozen later stays one model (tests/multirank/test_diloco_gloo.py
    checks that across ranks)."""
    model = _model()
    next(model.parameters()).requires_grad_(False)
    _, opt = _make(model)
    assert sum(f.numel for f in opt.parts) == sum(p.numel() for p in model.parameters())


def test_parameters_of_no_elements_train_and_report_zero_rates() -> None:
    """A model whose only parameter has no elements (a head sized by the data, empty here):
    it steps and syncs, and ``comm_stats()`` reports rates of 0 (it divided by zero)."""
    empty = torch.nn.Parameter(torch.ones(0))
    opt = commopt.DiLoCo(
        torch.optim.AdamW([empty], lr=1e-2), sync_every=2, backend=SingleProcessBackend()
    )
    for _ in range(4):
        empty.grad = torch.ones_like(empty)
        opt.step()
    stats = opt.comm_stats()
    assert (stats["steps"], stats["syncs"], stats["parameters"]) == (4, 2, 0)
    assert stats["bits_per_parameter_per_step"] == 0.0
    assert stats["compressed_bits_per_parameter_per_step"] == 0.0


def test_it_is_a_torch_optimizer_that_schedulers_drive_and_that_refuses_new_groups() -> None:
    """An LR scheduler on DiLoCo sets the inner optimizer's lr, as on the inner one itself;
    its state dict goes round; a new parameter group and a DiLoCo inside are refused."""
    model, opt = _make()
    twin_model, twin = _make()
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8)
    twin_sched = torch.optim.lr_scheduler.CosineAnnealingLR(twin.inner, T_max=8)
    for step in range(1, 7):
        _train(model, opt, [step])
        _train(twin_model, twin, [step])
        sched.step()
        twin_sched.step()
    assert opt.param_groups[0]["lr"] == twin.inner.param_groups[0]["lr"] < 1e-2
    pairs = zip(model.parameters(), twin_model.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    opt.load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="add the parameter group to the inner optimizer first"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    # added to the inner optimizer directly, the group would train and never sync
    extra = torch.nn.Parameter(torch.ones(2))
    opt.inner.add_param_group({"params": [extra]})
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"held when DiLoCo was built; the inner optimizer now"):
        _train(model, opt, [1])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(TypeError, match="other than DiLoCo, got DiLoCo"):
        commopt.DiLoCo(opt, sync_every=2, backend=SingleProcessBackend())


def test_torch_optimizer_hooks_run_around_its_step_and_state_dicts() -> None:
    """The hooks any torch optimizer takes (EMA and logging libraries register them) run on
    DiLoCo's own step and state dicts: torch's global step hooks see one optimizer step,
    DiLoCo's (the inner step is part of it); state-dict hooks may rewrite it."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    model, opt = _make()
    calls: list[object] = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o)))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o)))
    handle = register_optimizer_step_post_hook(
        lambda o, args, kwargs: calls.append(("global", type(o).__name__))
    )
    try:
        _train(model, opt, [1])
    finally:
        handle.remove()
    assert calls == [("pre", opt), ("post", opt), ("global", "DiLoCo")]

    opt.register_state_dict_pre_hook(lambda o: calls.append("saving"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "mine": 1})
    saved = opt.state_dict()
    assert calls[-1] == "saving" and saved["mine"] == 1
    opt.register_load_state_dict_pre_hook(
        lambda o, sd: {k: v for k, v in sd.items() if k != "mine"}
    )
    opt.register_load_state_dict_post_hook(lambda o: calls.append("loaded"))
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append(sorted(sd)))
    opt.load_state_dict(saved)
    assert calls[-2:] == [sorted(k for k in saved if k != "mine"), "loaded"]
    assert "mine" in saved  # the caller's dict is left as it was


def test_pickling_and_deepcopy_are_refused_not_half_done() -> None:
    """torch.optim.Optimizer's __getstate__ keeps the groups and the state alone: the copy
    would lack the backend, anchors and error buffers."""
    import copy
    import pickle

    _, opt = _make()
    for copier in (copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match=r"save opt\.state_dict"):
            copier(opt)


def test_fragments_are_contiguous_whole_tensors_of_about_equal_size() -> None:
    params = [torch.zeros(n) for n in (100, 10, 10, 80, 5, 95, 100)]
    for k in range(1, len(params) + 1):
        runs = split_parameters(params, k)
        assert len(runs) == k and all(runs)
        assert [id(p) for run in runs for p in run] == [id(p) for p in params]
    sizes = [sum(p.numel() for p in run) for run in split_parameters(params, 2)]
    assert sizes == [200, 200]
    with pytest.raises(ValueError, match="fragments=8 but only 7 parameter tensor"):
        split_parameters(params, 8)


def test_the_fragments_share_one_pseudo_gradient_buffer_the_size_of_the_largest() -> None:
    # one fragment's sync at a time is in flight (delay < H/P): Δ needs 4/P bytes per parameter
    _, opt = _make(sync_every=6, fragments=3, delay=1)
    storages = {f.delta.untyped_storage().data_ptr() for f in opt.parts}
    largest = max(f.numel for f in opt.parts)
    assert len(storages) == 1
    assert opt.parts[0].delta.untyped_storage().nbytes() == 4 * largest
    assert [f.delta.numel() for f in opt.parts] == [f.numel for f in opt.parts]
    assert largest < sum(f.numel for f in opt.parts)


def test_fragment_p_first_syncs_at_floor_p_plus_one_h_over_p() -> None:
    assert first_sync_offsets(10, 1) == [10]
    assert first_sync_offsets(10, 4) == [2, 5, 7, 10]
    assert first_sync_offsets(100, 4) == [25, 50, 75, 100]


def test_one_process_fp32_plain_averaging_lands_on_the_inner_optimizers_weights() -> None:
    ref_model = _model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    _train(ref_model, ref, range(1, 9))
    model, opt = _make(compression="none", outer_lr=1.0)  # plain averaging
    _train(model, opt, range(1, 9))
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        # θ̄ − (θ̄ − θ) may round by an ulp of θ̄
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert opt.comm_stats()["bytes_sent"] == 0 and opt.comm_stats()["syncs"] == 2


def test_bf16_average_rounds_once_to_bf16() -> None:
    x = torch.randn(37)
    y = x.clone()
    Bf16Average(SingleProcessBackend()).average_(y, {})
    assert torch.equal(y, x.to(torch.bfloat16).float())


def test_a_non_finite_pseudo_gradient_is_named() -> None:
    with pytest.raises(commopt.NonFiniteError, match=r"rank\(s\) \[0\]"):
        check_finite(SingleProcessBackend(), torch.tensor([1.0, float("inf")]))


def _digest(model, opt) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    out += [v.clone() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return out + [f.anchor.clone() for f in opt.parts]


def test_a_state_dict_with_other_settings_is_refused_and_changes_nothing() -> None:
    model, opt = _make(sync_every=4)
    _train(model, opt, range(1, 7))
    other_model, other = _make(sync_every=5)
    _train(other_model, other, range(1, 4))
    before = _digest(other_model, other)
    with pytest.raises(ValueError, match="sync_every saved 4, here 5"):
        other.load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="not a DiLoCo state dict"):
        other.load_state_dict(other.inner.state_dict())
    # torch's state-dict API keeps "state" and "param_groups" alone: the message says so
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    with pytest.raises(ValueError, match="get_optimizer_state_dict keep only"):
        other.load_state_dict(get_optimizer_state_dict(other_model, other))
    assert all(torch.equal(a, b) for a, b in zip(before, _digest(other_model, other), strict=True))
    assert other.progress.step == 3


def test_a_state_dict_from_before_fp32_syncs_loads_as_zero_fp32_syncs() -> None:
    model, opt = _make(fp32_syncs=0)
    _train(model, opt, range(1, 6))
    saved = opt.state_dict()
    del saved["commopt"]["settings"]["fp32_syncs"]  # what a state dict saved before it holds
    del saved["commopt"]["bytes"]["fp32"]
    _, same = _make(fp32_syncs=0)
    same.load_state_dict(saved)
    assert same.progress.step == 5 and same.progress.bytes["fp32"] == 0
    _, other = _make()  # today's default at H = 4: ⌈50/4⌉ = 13 syncs at fp32
    with pytest.raises(ValueError, match="fp32_syncs saved 0, here 13"):
        other.load_state_dict(saved)


@pytest.mark.parametrize(
    ("compression", "sync_every", "expected"),
    [
        ("onebit", 10, 5),
        ("onebit", 20, 3),
        ("onebit", 50, 2),
        ("onebit", 500, 2),
        ("onebit", 7, 8),
        ("none", 10, 0),
        ("bf16", 50, 0),
    ],
)
def test_fp32_syncs_defaults_to_the_syncs_of_the_first_50_steps_and_two_at_least_with_onebit(
    compression, sync_every, expected
) -> None:
    _, opt = _make(compression=compression, sync_every=sync_every)
    assert opt.fp32_syncs == expected == opt.settings()["fp32_syncs"]
    assert f"fp32_syncs={expected}" in repr(opt)
    _, explicit = _make(compression=compression, sync_every=sync_every, fp32_syncs=0)
    assert explicit.fp32_syncs == 0


def test_resume_mid_interval_is_bit_exact_with_momentum_and_warmup() -> None:
    kw = dict(sync_every=3, outer_lr=0.7, outer_momentum=0.9, warmup_steps=2, compression="bf16")
    model, opt = _make(**kw)
    _train(model, opt, range(1, 15))
    whole = [p.detach().clone() for p in model.parameters()]
    model, opt = _make(**kw)
    _train(model, opt, range(1, 7))
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    model, opt = _make(**kw)
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    _train(model, opt, range(7, 15))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), whole, strict=True))


def test_a_commopt_optimizer_inside_resumes_exactly_with_its_own_state_part() -> None:
    def build():
        model = _model()
        inner = commopt.OnebitAdam(
            model.parameters(), lr=1e-2, freeze_step=2, backend=SingleProcessBackend()
        )
        return _make(model, inner=inner, sync_every=3)

    model, opt = build()
    _train(model, opt, range(1, 10))
    whole = [p.detach().clone() for p in model.parameters()]
    model, opt = build()
    _train(model, opt, range(1, 5))
    sd = copy.deepcopy((model.state_dict(), opt.state_dict()))
    assert sorted(sd[1]["commopt"]["inner"]) == sorted(opt.inner.state_dict()["commopt"])
    model, opt = build()
    model.load_state_dict(sd[0])
    opt.load_state_dict(sd[1])
    _train(model, opt, range(5, 10))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), whole, strict=True))
