"""step_guard: Adam's step bound, the clamp, and how it compares with the other guards."""

from __future__ import annotations

import math

import pytest
import torch

from commopt.optim.adam import adam_step_bound, bound_step_

BETAS = [(0.9, 0.999), (0.9, 0.99), (0.9, 0.96), (0.5, 0.3), (0.0, 0.9)]


def _adam_ratios(grads: torch.Tensor, beta1: float, beta2: float, bias_correction: bool):
    """max_t |m_t|/√v_t (|m̂/√v̂| with bias correction) of exact Adam over a gradient sequence,
    per element, in float64. grads: [T, k]."""
    m = torch.zeros(grads.shape[1], dtype=torch.float64)
    v = torch.zeros_like(m)
    worst = torch.zeros_like(m)
    for t, g in enumerate(grads.double(), start=1):
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        r = m.abs() / v.sqrt()
        if bias_correction:
            r = r * math.sqrt(1 - beta2**t) / (1 - beta1**t)
        worst = torch.maximum(worst, torch.nan_to_num(r, nan=0.0))
    return worst


@pytest.mark.parametrize(("beta1", "beta2"), BETAS)
@pytest.mark.parametrize("bias_correction", [False, True])
def test_no_adam_trajectory_exceeds_the_bound(beta1, beta2, bias_correction):
    bound = adam_step_bound(beta1, beta2, bias_correction)
    gen = torch.Generator().manual_seed(0)
    # random, heavy-tailed, sparse and decaying gradients, 2000 elements × 300 steps
    noise = torch.randn(300, 2000, generator=gen)
    sparse = noise * (torch.rand(300, 2000, generator=gen) < 0.05)
    decay = torch.exp(-torch.arange(300.0) / 30)[:, None] * noise.abs()
    heavy = noise**3
    for grads in (noise, sparse, decay, heavy):
        worst = _adam_ratios(grads, beta1, beta2, bias_correction)
        assert float(worst.max()) <= bound * (1 + 1e-9)


@pytest.mark.parametrize(("beta1", "beta2"), [(0.9, 0.999), (0.9, 0.99), (0.9, 0.96)])
def test_the_bound_is_tight(beta1, beta2):
    """Cauchy–Schwarz is an equality for |g_{t−k}| ∝ (β1/β2)^k: a gradient that grows by β2/β1
    per step drives |m/√v| to B (within 1 % after enough steps)."""
    steps = 3000 if beta2 == 0.999 else 800
    grads = (beta1 / beta2) ** torch.arange(steps - 1, -1, -1, dtype=torch.float64)
    worst = float(_adam_ratios(grads[:, None], beta1, beta2, False)[0])
    bound = adam_step_bound(beta1, beta2)
    assert 0.99 * bound <= worst <= bound * (1 + 1e-9)


def test_known_values_and_no_bound_when_beta1_squared_reaches_beta2():
    assert adam_step_bound(0.9, 0.999) == pytest.approx(0.1 / math.sqrt(0.001 * (1 - 0.81 / 0.999)))
    assert adam_step_bound(0.9, 0.999) == pytest.approx(7.2703, abs=1e-4)
    assert adam_step_bound(0.9, 0.96) == pytest.approx(1.2649, abs=1e-4)
    assert adam_step_bound(0.9, 0.81) == math.inf  # β1² = β2
    assert adam_step_bound(0.0, 0.0) == 1.0  # sign descent: |g|/|g|
    with pytest.raises(ValueError, match=r"Invalid betas: \(1.0, 0.9\)"):
        adam_step_bound(1.0, 0.9)


def test_clamp_keeps_every_bit_inside_the_bound_and_cuts_outside():
    u = torch.tensor([0.5, -7.0, 7.2703, 1e4, -3e5, float("nan"), 0.0, -0.0])
    ref = u.clone()
    out = bound_step_(u, 7.27)
    assert out is u
    inside = ref.abs() <= 7.27
    assert torch.equal(u[inside].view(torch.int32), ref[inside].view(torch.int32))
    assert u[3] == 7.27 and u[4] == -7.27 and u[2] == 7.27
    assert torch.isnan(u[5])
    same = torch.tensor([1e30, -1e30])
    assert torch.equal(bound_step_(same, math.inf), torch.tensor([1e30, -1e30]))
    with pytest.raises(ValueError, match="Invalid bound: 0"):
        bound_step_(u, 0)


def _compressed_like_step(scale: float):
    """What a 1-bit exchange hands an Adam step: every element gets ±s (s = the bucket's RMS of
    m), whatever its own variance. Elements: 90 ordinary, 5 with v = 0, 5 with v ~ 1e-15·v0.
    ``scale`` multiplies all gradients (a loss scaled by a constant)."""
    gen = torch.Generator().manual_seed(1)
    v = (torch.rand(100, generator=gen) + 0.5) * (1e-3 * scale) ** 2
    v[90:95] = 0.0
    v[95:] = 1e-15 * (1e-3 * scale) ** 2
    signs = torch.where(torch.rand(100, generator=gen) < 0.5, -1.0, 1.0)
    m = signs * (0.5e-3 * scale)  # ±s, s of the order of the ordinary elements' |m|
    return m, v


@pytest.mark.parametrize("scale", [1.0, 1e-4, 1e3])
def test_guards_compared_on_what_a_compressed_exchange_returns(scale):
    """The three guards on the same ±s momentum: the zero-variance mask leaves the tiny-v
    elements at ~1e5 times an ordinary step; an ε floor bounds them only when ε happens to
    suit the gradients' scale (and then also changes ordinary steps); the Adam bound cuts
    them to ≤ B at any scale and leaves every ordinary step bit-identical."""
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    m, v = _compressed_like_step(scale)
    plain = m / (v.sqrt() + eps)
    ordinary, zero, tiny = slice(0, 90), slice(90, 95), slice(95, 100)
    typical = float(plain[ordinary].abs().max())
    assert typical < 1.0

    # 1. the zero-variance mask (SPEC §8): v == 0 elements stop, tiny-v elements do not
    masked = torch.where(v == 0, torch.zeros_like(plain), plain)
    assert float(masked[zero].abs().max()) == 0.0
    if scale >= 1.0:  # (for tiny gradients ε itself caps m/(√v + ε), here at ≈ 5)
        assert float(masked[tiny].abs().min()) > 1e4 * typical

    # 2. a plain ε floor of 1e-5 (1000× torch's default)
    floored = m / (v.sqrt() + 1e-5)
    if scale >= 1e3:  # gradients large: ε is invisible, tiny-v elements still explode
        assert float(floored[tiny].abs().min()) > 100 * typical
    if scale <= 1e-4:  # gradients small: ε now dominates every ordinary element too
        assert float((floored[ordinary] / plain[ordinary]).max()) < 0.5

    # 3. the Adam bound: every step ≤ B, ordinary ones untouched bit for bit
    bound = adam_step_bound(beta1, beta2)
    guarded = bound_step_(plain.clone(), bound)
    assert float(guarded.abs().max()) <= bound
    assert torch.equal(guarded[ordinary], plain[ordinary])
    want = torch.clamp(plain[tiny].abs(), max=bound)
    torch.testing.assert_close(guarded[tiny].abs(), want, rtol=1e-6, atol=0)
