"""OnebitLamb in one process (SPEC §3): the warmup is LAMB, the compression stage follows the
ten numbered steps (with the compressed allreduce the identity at n = 1), σ is mean-RMS/RMS,
the factor clamps hold. The checks all three optimizers share (arguments, bf16 state, resume,
…) are in test_optimizers_common.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import commopt
from commopt import OnebitLamb

SINGLE = commopt.SingleProcessBackend()
BETAS = (0.9, 0.99)


def make_params(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    """Tensors of very different magnitudes, one that never gets a gradient, one that is empty."""
    gen = torch.Generator().manual_seed(seed)
    shapes_scales = [((6, 4), 1.0), ((6,), 0.01), ((3, 6), 5.0), ((5,), 1.0), ((0, 3), 1.0)]
    return [
        torch.nn.Parameter((torch.randn(s, generator=gen) * k).to(dtype)) for s, k in shapes_scales
    ]


def set_grads(params: list[torch.Tensor], step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen) * (0.1 + i) + 0.3
        p.grad = torch.zeros_like(p) if i == 3 else g.to(p.dtype)  # tensor 3: m stays 0


def groups(params: list[torch.Tensor]) -> list[dict]:
    return [
        {"params": params[:2], "weight_decay": 0.1},
        {"params": params[2:], "lr": 0.02},
    ]


# min/max_coeff bite: the ratios of this problem fall on both sides of [0.05, 0.3]
KW = dict(
    trust_ratio="frozen",
    lr=0.05,
    betas=BETAS,
    eps=1e-6,
    factor_threshold=0.05,
    min_coeff=0.05,
    max_coeff=0.3,
)


class ReferenceLamb:
    """SPEC §3 written out tensor by tensor, independently of the optimizer (n = 1: C = id)."""

    def __init__(self, params, groups_hp, freeze_step):
        self.params = [p.detach().clone().float() for p in params]
        self.hp = groups_hp  # one dict of hyperparameters per tensor
        self.freeze_step = freeze_step
        k = len(params)
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.v_fresh = [None] * k
        self.c_bar = [0.0] * k
        self.sigma = [1.0] * k
        self.last = [1.0] * k
        self.coeffs = [1.0] * k
        self.t = 0

    def step(self, grads):
        self.t += 1
        if self.t <= self.freeze_step:
            for k, (p, g, h) in enumerate(zip(self.params, grads, self.hp, strict=True)):
                b1, b2 = h["betas"]
                self.m[k] = b1 * self.m[k] + (1 - b1) * g
                self.v[k] = b2 * self.v[k] + (1 - b2) * g * g
                u = self.m[k] / (self.v[k].sqrt() + h["eps"]) + h["weight_decay"] * p
                pn, un = p.norm().item(), u.norm().item()
                c = 1.0
                if pn != 0 and un != 0:
                    c = min(max(pn / un, h["min_coeff"]), h["max_coeff"])
                if c != 1.0:
                    self.c_bar[k] = h["coeff_beta"] * self.c_bar[k] + (1 - h["coeff_beta"]) * c
                self.coeffs[k] = c
                self.params[k] = p - h["lr"] * c * u
                if self.t == self.freeze_step:
                    self.v_fresh[k] = self.v[k].clone()
            return
        m_prev = [m.clone() for m in self.m]
        if self.t == self.freeze_step + 1:
            rho = [m.norm().item() / math.sqrt(m.numel()) for m in self.m if m.numel()]
            mean = sum(rho) / len(rho)
            for k, m in enumerate(self.m):
                r = m.norm().item() / math.sqrt(m.numel()) if m.numel() else 0.0
                self.sigma[k] = mean / r if r > 0 else 1.0
        for k, (p, g, h) in enumerate(zip(self.params, grads, self.hp, strict=True)):
            b1, b2 = h["betas"]
            m = (b1 * self.m[k] + (1 - b1) * g) * self.sigma[k] / self.sigma[k]
            self.m[k] = m
            g_hat = (m - b1 * m_prev[k]) / (1 - b1)
            self.v_fresh[k] = b2 * self.v_fresh[k] + (1 - b2) * g_hat * g_hat
            d = self.v[k].sqrt() + h["eps"]
            d_f = self.v_fresh[k].sqrt() + h["eps"]
            factor = (d / d_f).max().item() if m.numel() else 1.0
            u0 = m / d
            u = u0 + h["weight_decay"] * p
            if h["weight_decay"] > 0:
                ratio = min(1.0, u0.norm().item() / u.norm().item()) if u.norm() > 0 else 1.0
                factor = factor * ratio + (1 - ratio)
            factor = min(max(factor, h["factor_min"]), h["factor_max"])
            tau = h["factor_threshold"]
            factor = min(max(factor, self.last[k] * (1 - tau)), self.last[k] * (1 + tau))
            self.last[k] = factor
            c = self.c_bar[k] * factor
            self.coeffs[k] = c
            self.params[k] = p - h["lr"] * c * u


def per_tensor_hp(opt: OnebitLamb) -> list[dict]:
    config = dataclasses.asdict(opt.config)
    return [dict(g, **config) for g in opt.param_groups for _ in g["params"]]


def run_against_reference(freeze_step: int, steps: int):
    params = make_params()
    opt = OnebitLamb(groups(params), freeze_step=freeze_step, backend=SINGLE, **KW)
    ref = ReferenceLamb(params, per_tensor_hp(opt), freeze_step)
    history = []
    for t in range(1, steps + 1):
        set_grads(params, t)
        ref.step([p.grad.float() for p in params])
        opt.step()
        history.append((opt.get_lamb_coeffs(), list(ref.coeffs)))
        for k, p in enumerate(params):
            torch.testing.assert_close(p.detach(), ref.params[k], atol=1e-6, rtol=1e-5)
            st = opt.state[p]
            assert st["exp_avg"].dtype == torch.float32
            torch.testing.assert_close(st["exp_avg"], ref.m[k], atol=1e-7, rtol=1e-5)
            assert float(st["lamb_coeff_freeze"]) == pytest.approx(ref.c_bar[k], rel=1e-5)
            assert float(st["last_factor"]) == pytest.approx(ref.last[k], rel=1e-5)
            if t >= freeze_step:
                torch.testing.assert_close(
                    st["exp_avg_sq_fresh"], ref.v_fresh[k], rtol=1e-5, atol=1e-9
                )
    return opt, params, ref, history


def test_warmup_is_lamb_with_clamped_trust_ratio_and_ema():
    opt, params, _, history = run_against_reference(freeze_step=6, steps=6)
    # The clamps were really exercised: group 0's lower bound and group 1's upper bound.
    assert all(got[1] == pytest.approx(0.05) for got, _ in history)  # tiny weights: lower
    assert all(got[2] == pytest.approx(0.3) for got, _ in history)  # large weights: upper
    assert all(0.05 < got[0] < 10.0 for got, _ in history)  # in between: not clamped
    for got, want in history:
        assert got == pytest.approx(want, rel=1e-5)
    # The tensor with no gradient has zero update → c = 1 and its EMA never moved.
    assert history[-1][0][3] == 1.0 and float(opt.state[params[3]]["lamb_coeff_freeze"]) == 0.0
    # v_f is a copy of v at the freeze step, not a view of it.
    st = opt.state[params[0]]
    assert torch.equal(st["exp_avg_sq_fresh"], st["exp_avg_sq"])
    assert st["exp_avg_sq_fresh"].data_ptr() != st["exp_avg_sq"].data_ptr()


@pytest.mark.filterwarnings("ignore:OnebitLamb.*zero variance")  # the all-zero tensor
def test_compression_stage_follows_spec_steps_at_world_size_one():
    opt, params, ref, history = run_against_reference(freeze_step=4, steps=12)
    for k, p in enumerate(params):
        assert float(opt.state[p]["scaling_coeff"]) == pytest.approx(ref.sigma[k], rel=1e-5)
    assert all(math.isfinite(c) for c in history[-1][0])


@pytest.mark.filterwarnings("ignore:OnebitLamb.*zero variance")  # the all-zero tensor
def test_scaling_coeffs_are_mean_rms_over_rms_at_the_freeze_step():
    params = make_params(seed=3)
    opt = OnebitLamb(groups(params), freeze_step=3, backend=SINGLE, **KW)
    for t in range(1, 4):
        set_grads(params, t)
        opt.step()
    momentum = [opt.state[p]["exp_avg"].clone() for p in params]
    set_grads(params, 4)
    opt.step()
    rms = [m.norm() / math.sqrt(m.numel()) for m in momentum if m.numel()]
    mean = sum(rms) / len(rms)
    sigma = [float(opt.state[p]["scaling_coeff"]) for p in params]
    for k, m in enumerate(momentum[:3]):
        assert sigma[k] == pytest.approx(float(mean / (m.norm() / math.sqrt(m.numel()))), rel=1e-6)
    assert sigma[0] > 1 > sigma[2]  # small layers are scaled up, large ones down
    assert sigma[3] == 1.0  # all-zero momentum at the freeze point
    assert sigma[4] == 1.0  # no elements
    for _ in range(3):  # frozen from now on, and nothing became inf/NaN
        set_grads(params, 5)
        opt.step()
    assert [float(opt.state[p]["scaling_coeff"]) for p in params] == sigma
    for p in params:
        assert all(bool(torch.isfinite(v).all()) for v in opt.state[p].values())
        assert bool(torch.isfinite(p).all())


def test_factor_clamps_and_threshold_are_honoured():
    params = make_params(seed=5)
    kw = dict(KW, betas=(0.9, 0.5), factor_min=0.9, factor_max=1.2, factor_threshold=0.02)
    opt = OnebitLamb(params, freeze_step=2, backend=SINGLE, **kw)
    last = [1.0] * len(params)
    moved = False
    for t in range(1, 40):
        gen = torch.Generator().manual_seed(t)
        for p in params:  # gradients shrink fast: v_f falls below v and the raw factor grows
            p.grad = torch.randn(p.shape, generator=gen) * 10.0 ** (-t / 4)
        opt.step()
        now = [float(opt.state[p]["last_factor"]) for p in params]
        for a, b in zip(last, now, strict=True):
            assert 0.9 - 1e-6 <= b <= 1.2 + 1e-6
            assert abs(b - a) <= 0.02 * a + 1e-6
        moved |= any(abs(b - a) > 0.019 * a for a, b in zip(last, now, strict=True))
        last = now
    assert moved, "the threshold clamp was never reached: the test exercised nothing"
    assert max(last) == pytest.approx(1.2, rel=1e-6)


def test_get_lamb_coeffs_returns_a_copy():
    params = make_params()
    opt = OnebitLamb(params, freeze_step=2, backend=SINGLE)
    assert opt.get_lamb_coeffs() == []
    set_grads(params, 1)
    opt.step()
    coeffs = opt.get_lamb_coeffs()
    assert isinstance(coeffs, list) and len(coeffs) == len(params)
    coeffs[0] = -5.0
    assert opt.get_lamb_coeffs()[0] != -5.0
