"""torch.optim's contract where commopt's optimizers broke it (issue #38), one process.

Each test names the row of torch's ``TestOptimRenewed`` (pytorch test/test_optim.py) it follows,
and runs every optimizer of the registry with ``torch.optim.Adam`` as the control where the
control applies. The 2-rank counterparts are in ``tests/multirank/test_torch_contract_gloo.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.optim_registry import OPTIMIZERS, state_dict_diff

CONTROL = "Adam"


def _make(name: str, params, **overrides):
    if name == CONTROL:
        return torch.optim.Adam(params, **overrides)
    from tests.optim_registry import BY_NAME

    return BY_NAME[name].make(params, **overrides)


NAMES = [CONTROL] + [info.name for info in OPTIMIZERS]


def _steps(opt, params, n: int, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        opt.step()


@pytest.mark.parametrize("name", NAMES)
def test_lr_zero_through_every_phase_moves_nothing(name):
    # lr = 0 (CosineAnnealingLR's last value) crashed 1-bit Adam after the freeze step with a
    # ZeroDivisionError.
    w = torch.nn.Parameter(torch.randn(5, 3))
    before = w.detach().clone()
    opt = _make(name, [w], lr=0.0)
    _steps(opt, [w], 14)
    assert torch.equal(w, before)


@pytest.mark.parametrize("name", NAMES)
def test_deepcopy_steps_like_the_original(name):
    # test_deepcopy_copies_all_public_attrs: the copy has every public attribute, and steps
    # (it lost config and global_state: "no attribute '_early'").
    w = torch.nn.Parameter(torch.randn(6))
    opt = _make(name, [w], lr=0.01)
    _steps(opt, [w], 3)
    twin = copy.deepcopy(opt)
    public = {k for k in vars(opt) if not k.startswith("_")}
    assert public <= set(vars(twin)), public - set(vars(twin))
    w2 = twin.param_groups[0]["params"][0]
    assert w2 is not w and torch.equal(w2, w)
    _steps(opt, [w], 5, seed=1)
    _steps(twin, [w2], 5, seed=1)
    assert torch.equal(w, w2)
    assert state_dict_diff(opt.state_dict(), twin.state_dict()) == []


@pytest.mark.parametrize("name", [info.name for info in OPTIMIZERS])
def test_a_deepcopy_masks_with_its_own_param_groups(name):
    # The copy's exchange and mask are its own: a mask changed in the copy's group acts there
    # and not in the original (the mask once read the param groups through a closure over the
    # original optimizer, which deepcopy shares).
    w = torch.nn.Parameter(torch.randn(6))
    opt = _make(name, [{"params": [w], "exp_avg_mask": torch.ones(6)}], lr=0.01)
    twin = copy.deepcopy(opt)
    twin.param_groups[0]["exp_avg_mask"] = torch.zeros(6)
    w2 = twin.param_groups[0]["params"][0]
    _steps(opt, [w], 14)
    _steps(twin, [w2], 14)
    assert not torch.equal(w, w2)  # the copy's mask held its compressed steps back
    assert opt.state[w]["exp_avg"].abs().sum() > 0


@pytest.mark.parametrize("name", NAMES)
def test_float32_parameters_under_a_float64_default_dtype(name):
    # test_step_respects_default_dtype-like: torch.set_default_dtype(torch.float64) broke fp32
    # parameters ("expected dtype float for `end`"): scratch buffers took the default dtype.
    w = torch.nn.Parameter(torch.randn(6, dtype=torch.float32))
    ref = torch.nn.Parameter(w.detach().clone())
    ref_opt = _make(name, [ref], lr=0.01)
    _steps(ref_opt, [ref], 14)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        opt = _make(name, [w], lr=0.01)
        _steps(opt, [w], 14)
    finally:
        torch.set_default_dtype(previous)
    assert w.dtype == torch.float32
    assert torch.equal(w, ref)  # the same bits as under the float32 default


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": torch.tensor(0.01)}, "lr as a Tensor is not supported for capturable=False"),
        ({"lr": torch.tensor([0.01, 0.02])}, "Tensor lr must be 1-element"),
        ({"betas": (torch.tensor(0.9), 0.999)}, "betas must be either both floats or both"),
        (
            {"betas": (torch.tensor(0.9), torch.tensor(0.999))},
            r"betas\[0\] as a Tensor is not supported for capturable=False",
        ),
    ],
)
def test_tensor_hyperparameters_are_refused_clearly(info, kwargs, match):
    # Tensor lr or betas died inside numba with a typing error (0/1 Adam) or with "Boolean
    # value of Tensor ... ambiguous": refused in torch.optim.Adam's words for a step that is
    # not capturable (torch's test_tensor_lr accepts exactly that refusal), in the constructor
    # and in a param group.
    with pytest.raises(ValueError, match=match):
        info.make([torch.nn.Parameter(torch.randn(3))], **kwargs)
    key = next(iter(kwargs))
    group = {"params": [torch.nn.Parameter(torch.randn(3))], key: kwargs[key]}
    with pytest.raises(ValueError, match=f"{match}.* in a param group"):
        info.make([group])


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("option", ["maximize", "amsgrad", "capturable", "differentiable", "fused"])
def test_torch_only_options_are_refused_in_the_constructor_and_in_a_group(info, option):
    # They were silently ignored in a param group (a maximize=True group minimised).
    with pytest.raises(ValueError, match=rf"{option}=True: {info.name} has no {option} \("):
        info.make([torch.nn.Parameter(torch.randn(3))], **{option: True})
    group = {"params": [torch.nn.Parameter(torch.randn(3))], option: True}
    with pytest.raises(ValueError, match=rf"{option}=True in a param group: {info.name} has no"):
        info.make([group])
    opt = info.make([torch.nn.Parameter(torch.randn(3))])
    with pytest.raises(ValueError, match=rf"{option}=True in a param group"):
        opt.add_param_group(group)
    harmless = {"params": [torch.nn.Parameter(torch.randn(3))], option: False, "foreach": None}
    opt.add_param_group(harmless)  # False, and foreach (an implementation choice), are fine


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_torch_implementation_flags_are_taken_by_the_constructor_as_torch_takes_them(info):
    # Code written for torch.optim.Adam passes foreach=..., fused=False, maximize=False...:
    # commopt's one implementation takes foreach with any value and the others unset, with
    # the same bits as without them (torch's ported tests pass foreach=False on every row).
    def run(**flags):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(3, 4))
        opt = info.make([w], **flags)
        gen = torch.Generator().manual_seed(1)
        for _ in range(info.steps):
            w.grad = torch.randn(w.shape, generator=gen)
            opt.step()
        return w.detach()

    plain = run()
    for flags in (
        {"foreach": False},
        {"foreach": True},
        {"foreach": None, "fused": None, "maximize": False, "amsgrad": False},
        {"capturable": False, "differentiable": False, "fused": False},
    ):
        assert torch.equal(run(**flags), plain), flags


@pytest.mark.parametrize("name", NAMES)
def test_a_step_with_no_gradient_anywhere_changes_nothing_later(name):
    # torch counts steps per parameter with a gradient: a step() before any backward (or
    # after zero_grad(set_to_none=True)) is no step. It shifted every later step here.
    w = torch.nn.Parameter(torch.randn(6))
    twin = torch.nn.Parameter(w.detach().clone())
    opt, twin_opt = _make(name, [w], lr=0.01), _make(name, [twin], lr=0.01)
    for _ in range(3):
        opt.step()  # nothing has a gradient
    _steps(opt, [w], 14)
    _steps(twin_opt, [twin], 14)
    assert torch.equal(w, twin)
    if name != CONTROL:
        assert opt.global_state["step"] == twin_opt.global_state["step"] == 14


@pytest.mark.parametrize("info", [i for i in OPTIMIZERS if i.name != "ZeroOneAdam"], ids=repr)
def test_a_layer_unfrozen_after_the_warmup_trains_like_a_fresh_optimizer(info):
    # Gradual unfreezing: a parameter frozen through the whole warmup, then unfrozen, never
    # moved again (its variance was 0, frozen). It now starts its own schedule at its first
    # gradient, as torch.optim starts a parameter's state there: bit for bit a fresh optimizer.
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))
    fresh_b = torch.nn.Parameter(b.detach().clone())
    opt = info.make([a, b])
    fresh = None
    gen = torch.Generator().manual_seed(3)
    unfreeze = info.steps + 1  # past the freeze step
    for t in range(1, 2 * info.steps + 2):
        a.grad = torch.randn(a.shape, generator=gen)
        b.grad = torch.randn(b.shape, generator=gen) if t >= unfreeze else None
        if t == unfreeze:
            fresh = info.make([fresh_b])
        if fresh is not None:
            fresh_b.grad = b.grad.clone()
            fresh.step()
        opt.step()
        assert torch.equal(b, fresh_b), t
    assert opt.global_state["cohort_starts"] == {1: unfreeze - 1}
    assert not torch.equal(b, fresh_b.new_zeros(7))  # (it moved)
    # and it survives a state dict round trip: the same buckets after loading
    again = info.make([torch.nn.Parameter(a.detach().clone()), torch.nn.Parameter(b.detach())])
    again.load_state_dict(opt.state_dict())
    assert [s.bucket.numel for s in again.flat_states] == [s.bucket.numel for s in opt.flat_states]


def test_zero_one_adam_refuses_a_parameter_first_trained_after_the_variance_froze():
    from tests.optim_registry import BY_NAME

    info = BY_NAME["ZeroOneAdam"]
    a, b = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(4))
    opt = info.make([a, b])
    frozen = info.config["var_freeze_step"]
    for t in range(1, frozen + 2):
        a.grad = torch.randn(5)
        b.grad = torch.randn(4) if t == frozen + 1 else None
        if t == frozen + 1:
            with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] got a first"):
                opt.step()
        else:
            opt.step()
    # unfrozen in phase A instead, it trains
    c, d = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(4))
    start = d.detach().clone()
    opt = info.make([c, d])
    for t in range(1, frozen + 3):
        c.grad = torch.randn(5)
        d.grad = torch.randn(4) if t >= 2 else None
        opt.step()
    assert not torch.equal(d, start)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_a_state_dict_from_before_the_untrained_note_resumes_exactly(info):
    # State dicts saved before commopt noted which parameters never trained lack "tracked" and
    # "untrained": what they held must count as trained, or every parameter would restart
    # its warmup as a late starter.
    from tests.optim_registry import reload

    torch.manual_seed(0)
    w, twin = torch.nn.Parameter(torch.randn(9)), None
    opt = info.make([w])
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(9, generator=gen) for _ in range(info.steps)]
    for g in grads[:2]:
        w.grad = g.clone()
        opt.step()
    sd = reload(opt.state_dict())
    for key in ("tracked", "untrained"):
        del sd["commopt"]["global"][key]
    twin = torch.nn.Parameter(w.detach().clone())
    twin_opt = info.make([twin])
    twin_opt.load_state_dict(sd)
    for g in grads[2:]:
        w.grad, twin.grad = g.clone(), g.clone()
        opt.step()
        twin_opt.step()
    assert torch.equal(w, twin)
    assert "cohort_starts" not in twin_opt.global_state


# -- each parameter counts its own steps (torch's state[p]["step"]) ------------------------------
def _sit_out_run(opt, ref, a, b, a2, b2, steps, out):
    gen = torch.Generator().manual_seed(1)
    for t in range(1, steps + 1):
        ga, gb = torch.randn(a.shape, generator=gen), torch.randn(b.shape, generator=gen)
        a.grad, a2.grad = ga.clone(), ga.clone()
        sits_out = t in out
        b.grad, b2.grad = (None, None) if sits_out else (gb.clone(), gb.clone())
        opt.step()
        ref.step()


def test_a_parameter_that_sits_steps_out_counts_its_own_steps_as_torch_adam():
    # Its bias correction counted every optimizer step, torch's counts the steps it had a
    # gradient in: 1-bit Adam's warmup, which is Adam at n = 1, was 0.016 off torch.optim.Adam
    # after a layer sat out three steps. Now bit for bit, through a state-dict round trip.
    from tests.optim_registry import BY_NAME, reload

    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))
    a2, b2 = (torch.nn.Parameter(x.detach().clone()) for x in (a, b))
    info = BY_NAME["OnebitAdam"]
    opt = info.make([a, b], lr=0.01, freeze_step=1000)
    ref = torch.optim.Adam([a2, b2], lr=0.01)
    _sit_out_run(opt, ref, a, b, a2, b2, 9, out={3, 4, 8})
    assert torch.equal(a, a2) and torch.equal(b, b2)
    assert opt.state[b]["idle_steps"] == opt.state[b]["idle_variance_steps"] == 3
    assert "idle_steps" not in opt.state[a]  # (nothing new in the state of one that never did)
    again = info.make([a, b], lr=0.01, freeze_step=1000)
    again.load_state_dict(reload(opt.state_dict()))
    _sit_out_run(again, ref, a, b, a2, b2, 6, out={2})
    assert torch.equal(a, a2) and torch.equal(b, b2)
    assert again.state[b]["idle_steps"] == 4


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_a_parameter_sitting_out_steps_in_every_phase_resumes_bit_exactly(info):
    # The count is state: saved with state_dict(), and a run resumed after a parameter sat out
    # steps continues bit for bit (the steps it sits out fall in every phase of the schedule).
    from tests.optim_registry import reload

    def run(opt, a, b, steps, start=1):
        for t in range(start, start + steps):
            gen = torch.Generator().manual_seed(t)
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = None if t % 3 == 0 else torch.randn(b.shape, generator=gen)
            opt.step()

    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(6, 2)), torch.nn.Parameter(torch.randn(7))
    before = b.detach().clone()
    twin_a, twin_b = (torch.nn.Parameter(x.detach().clone()) for x in (a, b))
    opt, twin = info.make([a, b]), info.make([twin_a, twin_b])
    total = 2 * info.steps + 3
    run(opt, a, b, total)
    half = total // 2
    run(twin, twin_a, twin_b, half)
    resumed = info.make([twin_a, twin_b])
    resumed.load_state_dict(reload(twin.state_dict()))
    run(resumed, twin_a, twin_b, total - half, start=half + 1)
    assert torch.equal(a, twin_a) and torch.equal(b, twin_b)
    assert state_dict_diff(opt.state_dict(), resumed.state_dict()) == []
    assert not torch.equal(b, before)
    if "bias_correction" in opt.defaults:  # (1-bit LAMB corrects no bias: nothing to count)
        # (0/1 Adam counts in phase A; phase B's step sizes are the param group's)
        sat_out = sum(t % 3 == 0 for t in range(1, total + 1))
        assert 0 < opt.state[b]["idle_steps"] <= sat_out
