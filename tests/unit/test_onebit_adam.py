"""OnebitAdam in one process: torch.optim equivalence, an independent reference across the
freeze boundary (with masks), bucket boundaries (SPEC §2). The checks all three optimizers share
(arguments, sparse, non-finite skip, closure, state_dict, …) are in test_optimizers_common.py."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from commopt import OnebitAdam

TOL = 1e-6


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 9),
        torch.nn.Tanh(),
        torch.nn.Linear(9, 4),
        torch.nn.Tanh(),
        torch.nn.Linear(4, 1),
    )


DATA_X = torch.randn(64, 6, generator=torch.Generator().manual_seed(1))
DATA_Y = torch.randn(64, 1, generator=torch.Generator().manual_seed(2))


def loss_of(model: torch.nn.Module, batch: int = 0) -> torch.Tensor:
    sl = slice(16 * (batch % 4), 16 * (batch % 4) + 16)
    return ((model(DATA_X[sl]) - DATA_Y[sl]) ** 2).mean()


def train(model, opt, steps: int, start: int = 0) -> None:
    for k in range(start, start + steps):
        opt.zero_grad()
        loss_of(model, k).backward()
        opt.step()


def groups_of(model: torch.nn.Module, spec: list[dict]) -> list[dict]:
    """Split the model's parameters into len(spec) groups in order, with the given options."""
    params = list(model.parameters())
    per = math.ceil(len(params) / len(spec))
    return [{"params": params[i * per : (i + 1) * per], **opts} for i, opts in enumerate(spec)]


GROUPS = [
    {"lr": 3e-3, "betas": (0.9, 0.999), "weight_decay": 0.1},
    {"lr": 1e-2, "betas": (0.8, 0.99), "weight_decay": 0.0},
    {"lr": 5e-3, "betas": (0.95, 0.9), "weight_decay": 0.02},
]


# -- equivalence with torch.optim ---------------------------------------------------------------
def test_warmup_matches_adamw_with_several_groups():
    ours, theirs = make_model(), make_model()
    opt = OnebitAdam(groups_of(ours, GROUPS), eps=1e-7, freeze_step=1000)
    ref = torch.optim.AdamW(groups_of(theirs, GROUPS), eps=1e-7)
    for k in range(40):
        for model, o in ((ours, opt), (theirs, ref)):
            o.zero_grad()
            loss_of(model, k).backward()
            o.step()
    # The same fp32 operations as torch's (lerp, addcmul, sqrt/div/add, addcdiv): bit for bit.
    for p_ours, p_ref in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(p_ours, p_ref)
    # The state looks like torch's: per-parameter exp_avg / exp_avg_sq.
    for p_ours, p_ref in zip(ours.parameters(), theirs.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p_ours][key], ref.state[p_ref][key])


def test_warmup_without_weight_decay_matches_adam():
    ours, theirs = make_model(3), make_model(3)
    opt = OnebitAdam(ours.parameters(), lr=1e-2, betas=(0.85, 0.995), freeze_step=1000)
    ref = torch.optim.Adam(theirs.parameters(), lr=1e-2, betas=(0.85, 0.995))
    train(ours, opt, 40)
    train(theirs, ref, 40)
    for p_ours, p_ref in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(p_ours, p_ref)  # SPEC §2: exactly torch.optim.Adam at n = 1


# -- an independent reference for the whole algorithm at n = 1 -----------------------------------
def reference_run(model, groups_spec, steps, freeze_step, bias_correction, eps=1e-8, masks=None):
    """SPEC §2 at n = 1 in float64: warmup Adam, then frozen v; masks[i] (per parameter)
    multiplies parameter i's momentum after the freeze."""
    params = [p.detach().double().clone() for p in model.parameters()]
    owner = []
    per = math.ceil(len(params) / len(groups_spec))
    for i in range(len(params)):
        owner.append(i // per)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    work = copy.deepcopy(model)
    for t in range(1, steps + 1):
        with torch.no_grad():
            for w, p in zip(work.parameters(), params, strict=True):
                w.copy_(p)
        work.zero_grad()
        loss_of(work, t - 1).backward()
        for i, w in enumerate(work.parameters()):
            g = w.grad.double()
            opts = groups_spec[owner[i]]
            b1, b2 = opts["betas"]
            lr, wd = opts["lr"], opts["weight_decay"]
            m[i] = b1 * m[i] + (1 - b1) * g
            if t <= freeze_step:
                v[i] = b2 * v[i] + (1 - b2) * g * g
            elif masks is not None and masks[i] is not None:
                m[i] = m[i] * masks[i]
            tv = min(t, freeze_step)
            m_hat = m[i] / (1 - b1**t) if bias_correction else m[i]
            v_hat = v[i] / (1 - b2**tv) if bias_correction else v[i]
            params[i] = params[i] - lr * (m_hat / (v_hat.sqrt() + eps) + wd * params[i])
    return params, m, v


@pytest.mark.parametrize("bias_correction", [True, False])
def test_matches_reference_across_the_freeze_boundary(bias_correction):
    model = make_model(5)
    steps, freeze = 30, 12
    expected, m_ref, v_ref = reference_run(model, GROUPS, steps, freeze, bias_correction)
    opt = OnebitAdam(groups_of(model, GROUPS), freeze_step=freeze, bias_correction=bias_correction)
    train(model, opt, steps)
    for i, (p, q) in enumerate(zip(model.parameters(), expected, strict=True)):
        assert (p.double() - q).abs().max() <= TOL, f"parameter {i}"
        assert (opt.state[p]["exp_avg"].double() - m_ref[i]).abs().max() <= TOL
        assert (opt.state[p]["exp_avg_sq"].double() - v_ref[i]).abs().max() <= TOL


def test_variance_is_frozen_after_freeze_step():
    model = make_model()
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=5)
    train(model, opt, 5)
    frozen = [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
    moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    train(model, opt, 5, start=5)
    for p, v, m in zip(model.parameters(), frozen, moments, strict=True):
        assert torch.equal(opt.state[p]["exp_avg_sq"], v)
        assert not torch.equal(opt.state[p]["exp_avg"], m)


def test_exp_avg_mask_keeps_masked_momentum_at_zero():
    model = make_model(7)
    first = model[0].weight  # 9 x 6
    mask = torch.ones(9, 6)
    mask[2] = 0
    mask[:, 4] = 0
    spec = [{"lr": 1e-2, "betas": (0.9, 0.999), "weight_decay": 0.0}]
    masks = [mask if p is first else None for p in model.parameters()]
    expected, _, _ = reference_run(model, spec, 20, 8, True, masks=masks)
    groups = [
        {"params": [first], "exp_avg_mask": mask},
        {"params": [p for p in model.parameters() if p is not first]},
    ]
    opt = OnebitAdam(groups, lr=1e-2, freeze_step=8)
    train(model, opt, 8)
    assert opt.state[first]["exp_avg"][mask == 0].abs().sum() > 0, "warmup momentum is not masked"
    for k in range(8, 20):
        train(model, opt, 1, start=k)
        assert torch.count_nonzero(opt.state[first]["exp_avg"][mask == 0]) == 0, f"step {k + 1}"
        assert torch.count_nonzero(opt.state[first]["exp_avg"][mask == 1]) > 0
    for i, p in enumerate(model.parameters()):
        assert (p.double() - expected[i]).abs().max() <= TOL, f"parameter {i}"


def test_several_buckets_give_the_same_result_as_one():
    """Bucket boundaries (here inside and across param groups) do not change any number."""
    a, b = make_model(9), make_model(9)
    opt_a = OnebitAdam(groups_of(a, GROUPS), freeze_step=6)
    opt_b = OnebitAdam(groups_of(b, GROUPS), freeze_step=6)
    opt_b._bucket_numel = 20  # many small buckets
    train(a, opt_a, 12)
    train(b, opt_b, 12)
    assert len(opt_b.flat_states) > 3 and len(opt_a.flat_states) == 1
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_bucket_numel_argument_sets_the_layout_and_is_checked():
    a, b = make_model(9), make_model(9)
    opt_a = OnebitAdam(groups_of(a, GROUPS), freeze_step=6)
    opt_b = OnebitAdam(groups_of(b, GROUPS), freeze_step=6)
    opt_a._bucket_numel = 20
    opt_b_arg = OnebitAdam(groups_of(b, GROUPS), freeze_step=6, bucket_numel=20)
    del opt_b
    assert [s.bucket.numel for s in opt_a.flat_states] == [
        s.bucket.numel for s in opt_b_arg.flat_states
    ]
    with pytest.raises(ValueError, match=r"Invalid bucket_numel: 0 \(must be >= 1\)"):
        OnebitAdam(a.parameters(), bucket_numel=0)
    with pytest.raises(TypeError, match="bucket_numel must be an int, got float"):
        OnebitAdam(a.parameters(), bucket_numel=1e6)
