"""What the optimizers do with inputs torch.optim users pass without thinking: frozen parameters,
complex, float64 and meta-device parameters, param groups added mid-run (or refused, and then not
kept), a changed schedule on resume, and another rank's state dict (issue #15, items 1–4, 10,
11; issue #11, item 4)."""

from __future__ import annotations

import warnings

import pytest
import torch

import commopt
from commopt import OnebitLamb, ZeroOneAdam
from tests.optim_registry import OPTIMIZERS, OptimizerInfo


def _make(info: OptimizerInfo, params, **overrides):
    """The registry's optimizer, full precision for 2 steps only."""
    return info.make(params, **{"freeze": 2, "lr": 0.05, **overrides})


def _train(params, opt, steps, skip=()):
    for t in range(steps):
        opt.zero_grad()
        loss = sum(((p.float() - 0.3 * (t + 1)) ** 2).sum() for p in params if p.requires_grad)
        loss.backward()
        for p in skip:
            p.grad = None
        opt.step()


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_parameter_without_gradient_is_skipped_entirely(info):
    """#15.1: requires_grad=False in a decaying group: no decay, no momentum, as torch.optim."""
    w = torch.nn.Parameter(torch.randn(5))
    frozen = torch.nn.Parameter(torch.randn(4), requires_grad=False)
    before = frozen.detach().clone()
    opt = _make(info, [{"params": [w, frozen], "weight_decay": 0.1}])
    _train([w, frozen], opt, 8)
    assert torch.equal(frozen, before)
    assert all(
        float(v.abs().sum()) == 0 for k, v in opt.state[frozen].items() if k.startswith("exp")
    )
    assert not torch.equal(w.detach(), before[:1].expand(5))


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_complex_parameters_are_refused(info):
    """#15.2: the imaginary part used to be dropped with only torch's casting warning."""
    z = torch.nn.Parameter(torch.tensor([1 + 2j]))
    with pytest.raises(TypeError, match=r"complex parameters.*view_as_real"):
        _make(info, [z])


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_float64_parameters_are_refused(info):
    """#15.3: fp64 used to be computed in fp32 silently (0.9 came out as 0.9000000357627869)."""
    d = torch.nn.Parameter(torch.tensor([0.9], dtype=torch.float64))
    with pytest.raises(TypeError, match=r"float64 .*\.float\(\)"):
        _make(info, [d])
    opt = _make(info, [torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(TypeError, match="float64"):
        opt.add_param_group({"params": [d]})


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_a_group_refused_is_not_added_and_the_optimizer_steps_on(info):
    """The group used to stay in ``param_groups`` after its error: the next step failed with a
    KeyError ('first_step'), or would have stepped the float64 parameter in fp32."""
    w = torch.nn.Parameter(torch.randn(3))
    twin = torch.nn.Parameter(w.detach().clone())
    opt, alone = _make(info, [w]), _make(info, [twin])
    refused = [
        {"params": [torch.nn.Parameter(torch.ones(2, dtype=torch.float64))]},
        {"params": [torch.nn.Parameter(torch.ones(2))], "lr": "0.1"},
        {"params": [torch.nn.Parameter(torch.ones(2))], "maximize": True},
    ]
    for group in refused:
        with pytest.raises((TypeError, ValueError)):
            opt.add_param_group(group)
        assert len(opt.param_groups) == 1
    _train([w], opt, 4)
    _train([twin], alone, 4)
    assert torch.equal(w, twin)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_meta_device_parameters_say_what_to_do(info):
    """#15.10: a clear error instead of Tensor.item() from deep inside."""
    meta = torch.nn.Parameter(torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match=r"meta device.*materialise"):
        _make(info, [meta])


@pytest.mark.parametrize("info", [i for i in OPTIMIZERS if i.joins_after_freeze], ids=repr)
def test_group_added_after_the_freeze_runs_its_own_warmup(info):
    """#15.4: a parameter added after the freeze used to keep v = 0 forever and never train.
    Now its group starts its own schedule: it is exactly a fresh optimizer on it, shifted."""
    torch.manual_seed(0)
    w, late = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.tensor([5.0, -4.0]))
    twin = torch.nn.Parameter(late.detach().clone())
    opt = _make(info, [w])
    _train([w], opt, 5)  # past the freeze
    opt.add_param_group({"params": [late]})
    alone = _make(info, [twin])
    for t in range(6):
        for o, ps in ((opt, [w, late]), (alone, [twin])):
            o.zero_grad()
            sum(((p - 0.1 * t) ** 2).sum() for p in ps).backward()
            o.step()
        assert torch.equal(late, twin), t
    assert float(late.detach()[0]) < 5.0
    assert opt.param_groups[-1]["first_step"] == 5


def test_zero_one_adam_group_added_in_phase_a_trains_and_in_phase_b_is_refused():
    """#15.4 for 0/1 Adam: in phase A the new parameters get their variance on the variance
    steps that remain; after the freeze v is frozen, so the group is refused, not zeroed."""
    w, late = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.tensor([5.0]))
    opt = ZeroOneAdam([w], lr=0.05, var_freeze_step=6, var_update_scaler=4)
    _train([w], opt, 2)
    opt.add_param_group({"params": [late]})
    _train([w, late], opt, 10)  # through the freeze, into local steps
    assert 0 < float(late) < 5.0 and bool(torch.isfinite(late).all())
    with pytest.raises(ValueError, match=r"cannot add a param group at step 12.*var_freeze_step"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_resume_with_a_different_schedule_is_refused(info):
    """#11.4: freeze_step used to be neither saved nor checked: the phase changed silently."""
    field = info.freeze_key
    w = torch.nn.Parameter(torch.randn(3))
    opt = _make(info, [w])
    _train([w], opt, 3)
    sd = opt.state_dict()
    assert sd["commopt"]["config"][field] == 2
    other = _make(info, [torch.nn.Parameter(w.detach().clone())], freeze=7)
    with pytest.raises(ValueError, match=rf"{field}: saved 2, now 7.*allow_config_change=True"):
        other.load_state_dict(sd)
    assert other.global_state["step"] == 0  # refused with nothing loaded
    with pytest.warns(UserWarning, match=rf"changed config: {field}: saved 2, now 7"):
        other.load_state_dict(sd, allow_config_change=True)
    assert getattr(other.config, field) == 7 and other.global_state["step"] == 3


def test_config_is_one_frozen_place():
    opt = OnebitLamb([torch.nn.Parameter(torch.ones(2))], freeze_step=3, max_coeff=2.0)
    assert opt.config == commopt.optim.OnebitLambConfig(freeze_step=3, max_coeff=2.0)
    assert opt.freeze_step == 3  # reads through to the config
    with pytest.raises(AttributeError, match=r"part of OnebitLamb\.config"):
        opt.freeze_step = 10
    with pytest.raises(ValueError, match="max_coeff is one setting for the whole OnebitLamb"):
        OnebitLamb([{"params": [torch.nn.Parameter(torch.ones(2))], "max_coeff": 1.0}])


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_state_dict_records_rank_and_world_size(info):
    """#15.11: a state dict says whose error buffers it holds."""
    opt = _make(info, [torch.nn.Parameter(torch.ones(2))])
    _train(list(opt.param_groups[0]["params"]), opt, 3)
    comm = opt.state_dict()["commopt"]
    assert (comm["rank"], comm["world_size"], comm["exchange"]) == (0, 1, "flat")


def test_lamb_non_finite_momentum_skips_the_step_with_nothing_changed():
    """#15.9: with a huge lr the exchange used to raise after the step counter and the momentum
    had changed. Now the step is skipped and every buffer is as before (on every rank: the
    exchange agrees on finiteness; tests/multirank covers n = 2). Here σ·m overflows."""
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    opt = OnebitLamb([w], lr=0.01, freeze_step=2)
    _train([w], opt, 3)  # past step 3, where σ is frozen
    before = {k: v.clone() for k, v in opt.state[w].items()}
    p_before = w.detach().clone()
    opt.zero_grad()
    w.grad = torch.tensor([3e38, -3e38, 3e38])  # finite, but β1·m + (1−β1)·g·σ overflows
    opt.state[w]["scaling_coeff"].fill_(1e10)
    before["scaling_coeff"] = opt.state[w]["scaling_coeff"].clone()
    with pytest.warns(UserWarning, match="non-finite values to exchange.*skipped"):
        opt.step()
    assert opt.global_state["step"] == 3 and opt.global_state["skipped_steps"] == 1
    assert torch.equal(w, p_before)
    for k, v in opt.state[w].items():
        assert torch.equal(v, before[k]), k


def test_local_steps_skip_parameters_without_gradient():
    """#15.1 in 0/1 Adam's local steps: a frozen parameter does not decay between syncs."""
    w = torch.nn.Parameter(torch.randn(4))
    frozen = torch.nn.Parameter(torch.randn(3), requires_grad=False)
    before = frozen.detach().clone()
    opt = ZeroOneAdam(
        [{"params": [w, frozen], "weight_decay": 0.5}],
        lr=0.05,
        var_freeze_step=2,
        local_step_clipper=4,
        local_step_scaler=1,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train([w, frozen], opt, 12)
    assert torch.equal(frozen, before)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_a_table_path_as_backend_is_refused_at_construction(info):
    """#11.5: a path no longer builds a MixedBackend silently (a collective) at the first step."""
    with pytest.raises(TypeError, match=r"MixedBackend\.from_table"):
        _make(info, [torch.nn.Parameter(torch.ones(2))], backend="table.json")
