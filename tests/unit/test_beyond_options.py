"""The options of issue 13 on the three optimizers, in one process: freeze_step="auto",
OnebitLamb(trust_ratio="tracking" | "max"), step_guard, and their config checks."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch

import commopt
from commopt.optim.adam import adam_step_bound
from commopt.optim.freeze import AutoFreeze, VarianceLevel, settled_step
from tests.optim_registry import BY_NAME

SINGLE = commopt.SingleProcessBackend()


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _data(noise: float = 0.0):
    """A smooth target, plus label noise of std ``noise``: with noise the gradients stay
    noise-dominated, so v settles and the automatic freeze decides (without, v keeps falling
    as the model fits, and the rule waits)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(512, 6, generator=gen)
    y = torch.stack([torch.sin(x[:, 0] * 2), x[:, 1] * x[:, 2]], dim=1)
    if noise:
        y = y + noise * torch.randn(y.shape, generator=gen)
    return x, y


NOISY = 2.0  # the label noise of the automatic-freeze tests


def _train(model, opt, steps: range, noise: float = 0.0) -> None:
    x, y = _data(noise)
    for step in steps:
        idx = torch.arange(32) + (32 * step) % 480
        opt.zero_grad()
        ((model(x[idx]) - y[idx]) ** 2).mean().backward()
        opt.step()


def _state(opt, model) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out += [v.clone() for v in opt.state[p].values() if torch.is_tensor(v)]
    return out


def _auto(kind: str, params) -> torch.optim.Optimizer:
    """The registry's optimizer with the automatic freeze."""
    info = BY_NAME[kind]
    return info.make(params, freeze="auto", lr=0.01, backend=SINGLE, **info.dense_variance)


@pytest.mark.parametrize("kind", list(BY_NAME))
def test_auto_freeze_decides_once_logs_once_and_resumes_exactly(kind, caplog):
    steps = 160
    model = _model()
    opt = _auto(kind, model.parameters())
    with caplog.at_level(logging.INFO, logger="commopt.optim.freeze"):
        _train(model, opt, range(steps), NOISY)
    decided = opt.global_state["auto_freeze_step"]
    assert decided is not None and 40 <= decided < steps, decided
    assert opt.frozen_after() == decided
    logs = [r for r in caplog.records if "frozen automatically" in r.getMessage()]
    assert len(logs) == 1 and f"at step {decided}" in logs[0].getMessage()
    if "variance_updates" in opt.global_state:  # (0/1 Adam) v must have grown to its level
        beta2 = opt.param_groups[0]["betas"][1]
        assert opt.global_state["variance_updates"] >= settled_step(beta2, 0.05)
        assert opt.global_state["local_started"]
    final = _state(opt, model)

    for cut in (decided - 5, decided, decided + 7):  # before, at and after the decision
        model = _model()
        first = _auto(kind, model.parameters())
        _train(model, first, range(cut), NOISY)
        saved = copy.deepcopy(first.state_dict())
        resumed = _auto(kind, model.parameters())
        resumed.load_state_dict(saved)
        _train(model, resumed, range(cut, steps), NOISY)
        assert resumed.global_state["auto_freeze_step"] == decided, cut
        for a, b in zip(_state(resumed, model), final, strict=True):
            assert torch.equal(a, b), (kind, cut)


def test_auto_equals_a_fixed_freeze_at_the_step_it_chose():
    model = _model()
    opt = commopt.OnebitAdam(model.parameters(), lr=0.01, freeze_step="auto", backend=SINGLE)
    _train(model, opt, range(150), NOISY)
    decided = opt.global_state["auto_freeze_step"]
    auto_state = _state(opt, model)
    model = _model()
    fixed = commopt.OnebitAdam(model.parameters(), lr=0.01, freeze_step=decided, backend=SINGLE)
    _train(model, fixed, range(150), NOISY)
    for a, b in zip(_state(fixed, model), auto_state, strict=True):
        assert torch.equal(a, b)


def test_auto_freeze_level_is_what_autofreeze_sees():
    """The optimizer feeds AutoFreeze x_t = (1/K) Σ_k ln mean(√v̂_k), written out here from
    its state; replaying these through a fresh AutoFreeze gives the same decision."""
    model = _model()
    opt = commopt.OnebitAdam(model.parameters(), lr=0.01, freeze_step="auto", backend=SINGLE)
    levels = []
    for step in range(200):
        _train(model, opt, range(step, step + 1), NOISY)
        t = step + 1
        logs = [
            math.log(float((opt.state[p]["exp_avg_sq"].double() / (1 - 0.999**t)).sqrt().mean()))
            for p in model.parameters()
        ]
        levels.append(VarianceLevel(sum(logs), len(logs)))
        if opt.global_state.get("auto_freeze_step") is not None:
            break
    decided = opt.global_state["auto_freeze_step"]
    saved = opt.global_state["auto_freeze"]  # the window's max and min are logs we wrote out
    for s, x in saved["highs"] + saved["lows"]:
        assert x == pytest.approx(levels[s - 1].log_mean, rel=1e-12, abs=1e-12)
    replay = AutoFreeze()
    assert next(t for t, lv in enumerate(levels, 1) if replay.observe(t, lv)) == decided
    assert replay.last_change == pytest.approx(saved["last_change"], abs=1e-12)


def _lamb_reference(model, steps: int, freeze: int, lr: float, wd: float) -> None:
    """LAMB written out (no bias correction, clamped ‖p‖/‖u‖), v frozen after ``freeze``."""
    x, y = _data()
    state = {p: (torch.zeros_like(p), torch.zeros_like(p)) for p in model.parameters()}
    for step in range(steps):
        idx = torch.arange(32) + (32 * step) % 480
        model.zero_grad()
        ((model(x[idx]) - y[idx]) ** 2).mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                m, v = state[p]
                m.mul_(0.9).add_(p.grad, alpha=0.1)
                if step < freeze:
                    v.mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                u = m / (v.sqrt() + 1e-8) + wd * p
                pn, un = p.norm(), u.norm()
                c = (pn / un).clamp(0.01, 10.0) if pn > 0 and un > 0 else torch.tensor(1.0)
                p.sub_(lr * c * u)


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_tracking_trust_ratio_at_one_rank_is_lamb_with_frozen_variance(wd):
    steps, freeze, lr = 60, 20, 0.02
    ref = _model()
    _lamb_reference(ref, steps, freeze, lr, wd)
    model = _model()
    opt = commopt.OnebitLamb(
        model.parameters(),
        lr=lr,
        weight_decay=wd,
        freeze_step=freeze,
        trust_ratio="tracking",
        step_guard=False,  # the reference is LAMB's step as is (the guard cuts some here)
        backend=SINGLE,
    )
    _train(model, opt, range(steps))
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # the frozen rule (SPEC §3) follows another path: it must not match
    frozen = _model()
    opt = commopt.OnebitLamb(frozen.parameters(), lr=lr, weight_decay=wd, freeze_step=freeze)
    _train(frozen, opt, range(steps))
    pairs = zip(frozen.parameters(), ref.parameters(), strict=True)
    gap = max(float((a - b).abs().max()) for a, b in pairs)
    assert gap > 1e-3


def test_step_guard_bounds_tiny_variance_steps_and_leaves_others_alone():
    """A weight whose gradient was tiny all warmup, then large: without the guard its first
    compression-stage step is |m̂|/(√v̂+ε) ≫ B; with it, exactly lr·B. An ordinary weight moves
    identically with and without the guard."""

    def run(guard: bool) -> torch.Tensor:
        w = torch.nn.Parameter(torch.zeros(2))
        opt = commopt.OnebitAdam([w], lr=0.01, freeze_step=5, step_guard=guard, backend=SINGLE)
        for step in range(7):
            w.grad = torch.tensor([1.0, 1e-12 if step < 5 else 1.0])
            opt.step()
        return w.detach().clone()

    plain, guarded = run(False), run(True)
    assert plain[0] == guarded[0]  # |m̂/√v̂| ≈ 1 ≤ B: bit-identical
    bound = adam_step_bound(0.9, 0.999, bias_correction=True)
    assert abs(float(plain[1])) > 100 * 0.01 * bound  # ~1e9 steps without the guard
    steps_after_freeze = 2  # (the warmup moved it by ~1e-6: its m̂/(√v̂ + ε) is ~1e-4)
    assert abs(float(guarded[1])) <= 0.01 * bound * steps_after_freeze + 1e-5


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: commopt.OnebitAdam(p, freeze_step="soon"), "Invalid freeze_step: 'soon'"),
        (lambda p: commopt.OnebitAdam(p, freeze_step=0), "Invalid freeze_step: 0"),
        (lambda p: commopt.ZeroOneAdam(p, var_freeze_step="x"), "Invalid var_freeze_step: 'x'"),
        (lambda p: commopt.OnebitLamb(p, trust_ratio="live"), "Invalid trust_ratio: 'live'"),
        (lambda p: commopt.OnebitAdam(p, error_feedback="ef21"), "Invalid error_feedback"),
        (lambda p: commopt.ZeroOneAdam(p, econtrol_eta=-1.0), "Invalid econtrol_eta: -1.0"),
    ],
)
def test_invalid_options_are_rejected(make, match):
    with pytest.raises(ValueError, match=match):
        make([torch.nn.Parameter(torch.zeros(2))])


def test_options_are_in_the_config_and_the_exchange_follows_them():
    w = torch.nn.Parameter(torch.zeros(3))
    opt = commopt.OnebitLamb(
        [w], trust_ratio="tracking", error_feedback="econtrol", econtrol_eta=0.1, backend=SINGLE
    )
    assert opt.config.trust_ratio == "tracking" and opt.config.econtrol_eta == 0.1
    assert opt.exchange.name == "flat-econtrol" and opt.exchange.eta == 0.1
    assert commopt.OnebitAdam([w], backend=SINGLE).exchange.name == "flat"
    assert math.isinf(commopt.OnebitAdam([w], freeze_step="auto").frozen_after())


def _max_rule_reference(p, g, st, group, cfg) -> tuple[torch.Tensor, float, float, float]:
    """One compression step of trust_ratio="max" at n = 1 (the exchange is the identity) in
    float64: SPEC §3 steps 1–10, then c = max(c̄·f, clip(‖p‖/‖u‖)). Returns (p', c, c̄·f, clip)."""
    p, g = p.double(), g.double()
    m, v, v_f = (st[k].double() for k in ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh"))
    (b1, b2), eps, wd = group["betas"], group["eps"], group["weight_decay"]
    m_new = b1 * m + (1 - b1) * g
    g_hat = (m_new - b1 * m) / (1 - b1)
    v_f = b2 * v_f + (1 - b2) * g_hat**2
    f = float(((v.sqrt() + eps) / (v_f.sqrt() + eps)).max())
    u0 = m_new / (v.sqrt() + eps)
    u = u0 + wd * p
    if wd > 0:
        r = min(1.0, float(u0.norm() / u.norm()))
        f = f * r + (1 - r)
    last = float(st["last_factor"])
    tau = cfg.factor_threshold
    f = min(max(min(max(f, cfg.factor_min), cfg.factor_max), last * (1 - tau)), last * (1 + tau))
    frozen = float(st["lamb_coeff_freeze"]) * f
    tracking = min(max(float(p.norm() / u.norm()), cfg.min_coeff), cfg.max_coeff)
    c = max(frozen, tracking)
    return p - group["lr"] * c * u, c, frozen, tracking


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_max_trust_ratio_is_the_larger_of_frozen_and_tracking(wd):
    """trust_ratio="max", step by step against a float64 re-statement: each compression step's
    c_k is max(c̄_k·f_k, clip(‖p_k‖/‖u_k‖)), and both branches are taken."""
    model = _model(3)
    opt = commopt.OnebitLamb(
        model.parameters(),
        lr=0.02,
        weight_decay=wd,
        freeze_step=4,
        trust_ratio="max",
        coeff_beta=0.0,  # c̄ = the last warmup ratio and f rises to >= 2 at 10 % a step:
        factor_min=2.0,  # c̄·f is the larger one for some steps, ‖p‖/‖u‖ for others
        step_guard=False,  # the reference is the paper's step as is
        backend=SINGLE,
    )
    _train(model, opt, range(4))
    x, y = _data()
    branches = set()
    for step in range(4, 40):
        idx = torch.arange(32) + (32 * step) % 480
        opt.zero_grad()
        ((model(x[idx]) - y[idx]) ** 2).mean().backward()
        group = opt.param_groups[0]
        want = [
            _max_rule_reference(p.detach(), p.grad, opt.state[p], group, opt.config)
            for p in model.parameters()
        ]
        opt.step()
        for p, c, (p_ref, c_ref, frozen, tracking) in zip(
            model.parameters(), opt.get_lamb_coeffs(), want, strict=True
        ):
            assert c == pytest.approx(c_ref, rel=1e-5), step
            torch.testing.assert_close(p.detach().double(), p_ref, rtol=1e-5, atol=1e-7)
            if tracking > 1.001 * frozen:
                branches.add("tracking")
            elif frozen > 1.001 * tracking:
                branches.add("frozen")
    assert branches == {"frozen", "tracking"}


def test_max_trust_ratio_resume_is_exact():
    """No new state: c̄, f^last and the last c are in state_dict, so a resume is bit-exact."""

    def make(model):
        return commopt.OnebitLamb(
            model.parameters(), lr=0.02, freeze_step=4, trust_ratio="max", backend=SINGLE
        )

    model = _model(3)
    opt = make(model)
    _train(model, opt, range(8))
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    _train(model, opt, range(8, 20))
    clone = _model(9)
    clone.load_state_dict(saved["model"])
    opt2 = make(clone)
    opt2.load_state_dict(saved["opt"])
    _train(clone, opt2, range(8, 20))
    for a, b in zip(_state(opt, model), _state(opt2, clone), strict=True):
        assert torch.equal(a, b)
