"""step_guard="tiny" (the default): the clamp |m/(√v+ε)| ≤ B acts only on elements whose v is
below 1 % of their own tensor's mean v. Against a float64 re-statement, bit-identical to the
papers' step on every other element, resume-exact, and the value checks."""

from __future__ import annotations

import math

import pytest
import torch

import commopt
from commopt.optim.adam import TINY_VARIANCE, adam_step_bound
from tests.optim_registry import BY_NAME

SINGLE = commopt.SingleProcessBackend()
DEFAULT = object()  # pass no step_guard at all
LR, FREEZE, STEPS = 0.01, 6, 14


def _grads(t: int) -> list[torch.Tensor]:
    """Step t's gradients. Tensor ``a``: elements 0–3 ordinary; element 4 tiny (1e-5) during
    the warmup, ordinary after it, so its frozen v is ~1e-10 of the mean; element 5 small
    (0.3) all along, v ≈ 9 % of the mean: not "tiny". Tensor ``b``: uniformly small gradients
    (1e-4): its v is tiny next to ``a``'s but not next to its own mean, so it is not touched."""
    gen = torch.Generator().manual_seed(t)
    a = torch.randn(6, generator=gen).abs_() + 0.5
    if t <= FREEZE:
        a[4] = 1e-5
    a[5] = 0.3 * (1 if t % 2 else -1)
    b = 1e-4 * (torch.randn(3, generator=gen) + 2.0)
    return [a, b]


def _make(params, kind: str, guard=DEFAULT):
    info, kw = BY_NAME[kind], {} if guard is DEFAULT else {"step_guard": guard}
    return info.make(params, freeze=FREEZE, lr=LR, backend=SINGLE, **info.dense_variance, **kw)


def _run(guard, steps: int = STEPS, kind: str = "OnebitAdam"):
    params = [torch.nn.Parameter(torch.zeros(6)), torch.nn.Parameter(torch.zeros(3))]
    opt = _make(params, kind, guard)
    for t in range(1, steps + 1):
        for p, g in zip(params, _grads(t), strict=True):
            p.grad = g.clone()
        opt.step()
    return params, opt


def _reference(guard: bool) -> list[torch.Tensor]:
    """1-bit Adam at n = 1 in float64 (SPEC §2: the exchange returns the buffer as it is):
    Adam with bias correction for the warmup, then v̂ frozen with the bias factor of step
    FREEZE; with ``guard``, u = m̂/(√v̂+ε) clamped to ±B where v < 1 % of its tensor's mean."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    bound = adam_step_bound(b1, b2, bias_correction=True)
    p = [torch.zeros(6, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    for t in range(1, STEPS + 1):
        for k, g in enumerate(_grads(t)):
            g = g.double()
            m[k] = b1 * m[k] + (1 - b1) * g
            if t <= FREEZE:
                v[k] = b2 * v[k] + (1 - b2) * g * g
            vt = min(t, FREEZE)
            u = (m[k] / (1 - b1**t)) / ((v[k] / (1 - b2**vt)).sqrt() + eps)
            if guard and t > FREEZE:
                tiny = v[k] < TINY_VARIANCE * v[k].mean()
                u = torch.where(tiny, u.clamp(-bound, bound), u)
            p[k] = p[k] - LR * u
    return p


def test_tiny_guard_matches_a_float64_restatement():
    got, _ = _run("tiny")
    want = _reference(guard=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.detach().double(), w, rtol=1e-5, atol=1e-7)
    # the clamp did bind on element 4 (unguarded, it runs away by orders of magnitude)
    free = _reference(guard=False)
    assert abs(float(free[0][4])) > 1e3 * abs(float(want[0][4]))


def test_only_tiny_elements_change_and_every_other_bit_is_the_papers():
    tiny, _ = _run("tiny")
    off, _ = _run(False)
    every, _ = _run(True)
    changed = (tiny[0] != off[0]).nonzero().reshape(-1).tolist()
    assert changed == [4]  # element 5 (v ≈ 9 % of the mean) and tensor b are untouched
    assert torch.equal(tiny[1], off[1])
    assert tiny[0][4] == every[0][4]  # where it acts, it is the same clamp as True


@pytest.mark.parametrize("kind", list(BY_NAME))
def test_default_is_tiny_and_resume_is_bit_exact(kind):
    whole, opt = _run(DEFAULT, kind=kind)
    assert opt.config.step_guard == "tiny"
    explicit, _ = _run("tiny", kind=kind)
    off, _ = _run(False, kind=kind)
    assert not torch.equal(whole[0], off[0])  # the guard acted in this run
    half, opt_half = _run(DEFAULT, steps=FREEZE + 3, kind=kind)
    saved = opt_half.state_dict()
    params = [torch.nn.Parameter(p.detach().clone()) for p in half]
    opt2 = _make(params, kind)
    opt2.load_state_dict(saved)
    for t in range(FREEZE + 4, STEPS + 1):
        for p, g in zip(params, _grads(t), strict=True):
            p.grad = g.clone()
        opt2.step()
    for a, b, c in zip(params, whole, explicit, strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)


def test_zero_one_adam_guard_acts_in_both_phases_on_tiny_elements_only():
    tiny, _ = _run("tiny", kind="ZeroOneAdam")
    off, _ = _run(False, kind="ZeroOneAdam")
    assert torch.equal(tiny[1], off[1])
    assert torch.equal(tiny[0][:4], off[0][:4])
    assert torch.isfinite(tiny[0]).all()
    assert abs(float(tiny[0][4])) < abs(float(off[0][4]))


@pytest.mark.parametrize("bad", ["all", 1, 0, None, "off"])
def test_invalid_step_guard_is_rejected_with_the_choices(bad):
    w = torch.nn.Parameter(torch.zeros(2))
    choices = r"\(choose one of 'tiny', True, False\)"
    with pytest.raises(ValueError, match=r"Invalid step_guard: .* " + choices):
        commopt.OnebitAdam([w], step_guard=bad)


def test_tiny_threshold_is_per_tensor_and_cached_per_value_of_v():
    _, opt = _run("tiny")
    state = opt.flat_states[0]
    first = state.tiny_variance(TINY_VARIANCE)
    assert first is not None and first.tolist() == [4]  # offsets: a is 0–5, b is 6–8
    assert state.tiny_variance(TINY_VARIANCE) is first  # v frozen: not recomputed
    assert math.isclose(TINY_VARIANCE, 0.01)


def test_per_segment_indices_and_guarded_denominator_are_kept_while_v_is():
    """The per-segment indices and the guarded copy of d are kept from step to step while v is
    frozen, and rebuilt as soon as v (so d and the indices) changes."""
    _, opt = _run("tiny")
    state = opt.flat_states[0]  # a: elements 0–5, b: 6–8
    whole = state.tiny_variance_in(TINY_VARIANCE, 0, 9)
    assert whole.tolist() == [4]
    assert state.tiny_variance_in(TINY_VARIANCE, 2, 9).tolist() == [2]  # relative to start
    assert state.tiny_variance_in(TINY_VARIANCE, 6, 9) is None
    assert state.tiny_variance_in(TINY_VARIANCE, 0, 9) is whole  # kept
    d = state.denominator([1.0], [1e-8])
    base = state.guard_denominator_base(d)
    assert torch.equal(base, d) and base is not d
    base[4] = 123.0  # what the guard writes at its elements
    assert state.guard_denominator_base(d)[4] == 123.0  # kept: no copy of the whole bucket
    v = state.flat["exp_avg_sq"]
    v[4] = v[:6].mean()  # element 4 no longer tiny; v._version moves
    d = state.denominator([1.0], [1e-8])
    assert torch.equal(state.guard_denominator_base(d), d)  # refilled from the new d
    assert state.tiny_variance_in(TINY_VARIANCE, 0, 9) is None


def test_step_bound_is_computed_once_per_betas():
    adam_step_bound.cache_clear()
    first = adam_step_bound(0.9, 0.999, True)
    assert adam_step_bound(0.9, 0.999, True) == first
    assert adam_step_bound.cache_info().hits == 1
    assert adam_step_bound.__wrapped__(0.9, 0.999, True) == first
