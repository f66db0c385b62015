"""ZeroOneAdam in one process (SPEC §4): both schedules, the algorithm against an in-test
reference (at n = 1 nothing is dropped), a hand-checked sync, local non-finite skips. The checks
all three optimizers share (arguments, resume in every phase, …) are in
test_optimizers_common.py."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import commopt
from commopt import ZeroOneAdam

SINGLE = commopt.SingleProcessBackend()


def spec_schedule(var_freeze_step, var_update_scaler, local_step_scaler, clipper, steps):
    """Variance and sync steps, written from SPEC §4's prose, independently of the optimizer."""
    variance, sync = [], []
    interval, counter = 1, 0
    for t in range(1, var_freeze_step + 1):
        if t % interval == 0:
            variance.append(t)
            counter += 1
            if counter == var_update_scaler:
                counter, interval = 0, interval * 2
    interval, counter = 1, 0
    for t in range(var_freeze_step + 1, steps + 1):
        if t % interval == 0:
            sync.append(t)
        counter += 1
        if counter == local_step_scaler:
            counter, interval = 0, min(clipper, 2 * interval)
    return variance, sync


def test_reference_schedule_reproduces_the_spec_example():
    variance, _ = spec_schedule(30, 2, 3, 4, 30)
    assert variance == [1, 2, 4, 6, 8, 12, 16, 24]  # SPEC §4, verbatim


def test_variance_and_sync_steps_follow_spec():
    p = torch.nn.Parameter(torch.ones(5))
    opt = ZeroOneAdam(
        [p],
        lr=1e-3,
        var_freeze_step=30,
        var_update_scaler=2,
        local_step_scaler=3,
        local_step_clipper=4,
        backend=SINGLE,
    )
    variance, sync = [], []
    for t in range(1, 61):
        p.grad = torch.full_like(p, float(t))  # a new value every step: v moves iff updated
        v_before = opt.state[p]["exp_avg_sq"].clone() if t > 1 else torch.zeros(5)
        opt.step()
        if not torch.equal(opt.state[p]["exp_avg_sq"], v_before):
            variance.append(t)
        if t > 30 and opt.global_state["lrs"] == [0.0]:
            sync.append(t)
    want_variance, want_sync = spec_schedule(30, 2, 3, 4, 60)
    assert variance == want_variance == [1, 2, 4, 6, 8, 12, 16, 24]
    assert sync == want_sync
    assert sync[:8] == [31, 32, 33, 34, 36, 40, 44, 48]  # I_l = 1, 1, 1, 2, 2, 4 (clipped) …
    assert opt.global_state["local_interval"] == 4 and opt.global_state["var_interval"] == 16


class ReferenceZeroOne:
    """SPEC §4 at n = 1 (the compressed allreduce is the identity), tensor by tensor."""

    def __init__(self, params, lr, betas, eps, wd, freeze, scaler, local_scaler, clipper):
        self.p = [q.detach().clone() for q in params]
        self.m = [torch.zeros_like(q) for q in self.p]
        self.v = [torch.zeros_like(q) for q in self.p]
        self.hp = (lr, betas, eps, wd)
        self.variance, self.sync = spec_schedule(freeze, scaler, local_scaler, clipper, 10**4)
        self.freeze, self.t, self.lrs, self.p_sync = freeze, 0, 0.0, None

    def step(self, grads):
        lr, (b1, b2), eps, wd = self.hp
        self.t += 1
        for k, g in enumerate(grads):
            self.m[k] = b1 * self.m[k] + (1 - b1) * g  # phase A: g itself, nothing dropped
            if self.t in self.variance:
                self.v[k] = b2 * self.v[k] + (1 - b2) * g * g
        if self.t > self.freeze and self.p_sync is None:
            self.p_sync = [q.clone() for q in self.p]
        for k in range(len(self.p)):
            self.p[k] = self.p[k] - lr * (self.m[k] / (self.v[k].sqrt() + eps) + wd * self.p[k])
        if self.t > self.freeze:
            self.lrs += lr
            if self.t in self.sync:
                for k in range(len(self.p)):
                    d = self.v[k].sqrt() + eps
                    acc = (self.p[k] - self.p_sync[k]) * d
                    self.m[k] = -acc / self.lrs
                    self.p[k] = self.p_sync[k] + acc / d
                    self.p_sync[k] = self.p[k].clone()
                self.lrs = 0.0


def test_whole_run_matches_reference_at_world_size_one():
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(4, 3), (3,), (0,)]]
    hp = dict(lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05)
    sched = dict(var_freeze_step=9, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)
    opt = ZeroOneAdam(params, backend=SINGLE, bias_correction=False, **hp, **sched)  # SPEC §4
    ref = ReferenceZeroOne(params, 0.01, (0.8, 0.9), 1e-6, 0.05, 9, 2, 2, 4)
    for _ in range(25):
        grads = [torch.randn(q.shape, generator=gen) for q in params]
        for q, g in zip(params, grads, strict=True):
            q.grad = g.clone()
        opt.step()
        ref.step(grads)
        for k, q in enumerate(params):
            torch.testing.assert_close(q.detach(), ref.p[k], atol=1e-6, rtol=1e-5)
            # m ← −a/s divides a difference of nearby fp32 parameters by s = Ση: one rounding
            # of p (~1e-7) becomes ~1e-7·√v/s in m, hence the looser bound on m alone.
            torch.testing.assert_close(opt.state[q]["exp_avg"], ref.m[k], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(opt.state[q]["exp_avg_sq"], ref.v[k], atol=1e-7, rtol=1e-6)


def test_sync_step_by_hand():
    """One element, η = 0.1, β = (0.5, 0.5), ε = 0, λ = 0.1; phase B from step 2; the local
    interval becomes 2 after step 2, so step 3 is local and step 4 syncs (s = 2η)."""
    lr, wd = 0.1, 0.1
    p = torch.nn.Parameter(torch.tensor([1.0]))
    opt = ZeroOneAdam(
        [p],
        lr=lr,
        betas=(0.5, 0.5),
        eps=0.0,
        weight_decay=wd,
        var_freeze_step=1,
        local_step_scaler=1,
        local_step_clipper=2,
        backend=SINGLE,
        bias_correction=False,  # SPEC §4's numbers
    )
    grads = [2.0, 1.0, 3.0, -1.0]
    p.grad = torch.tensor([grads[0]])
    opt.step()
    m, v, x = 1.0, 2.0, 1.0 - lr * (1.0 / math.sqrt(2.0) + wd * 1.0)  # step 1, variance step
    assert p.item() == pytest.approx(x, rel=1e-6)
    d = math.sqrt(v)
    # Step 2: entry (p_sync = x), a local update, then a sync with s = η: a no-op in value.
    m = 0.5 * m + 0.5 * grads[1]
    x2 = x - lr * (m / d + wd * x)
    m, x_sync = -((x2 - x) * d) / lr, x2
    p.grad = torch.tensor([grads[1]])
    opt.step()
    assert p.item() == pytest.approx(x_sync, rel=1e-6)
    assert opt.state[p]["exp_avg"].item() == pytest.approx(m, rel=1e-5)
    # Step 3 (local) and step 4 (sync): m becomes the η-weighted mean of (m_i + λ·d·p_{i-1}).
    m3 = 0.5 * m + 0.5 * grads[2]
    x3 = x_sync - lr * (m3 / d + wd * x_sync)
    m4 = 0.5 * m3 + 0.5 * grads[3]
    x4 = x3 - lr * (m4 / d + wd * x3)
    p.grad = torch.tensor([grads[2]])
    opt.step()
    assert p.item() == pytest.approx(x3, rel=1e-6) and opt.global_state["lrs"] == [lr]
    assert opt.state[p]["p_sync"].item() == pytest.approx(x_sync, rel=1e-6)
    p.grad = torch.tensor([grads[3]])
    opt.step()
    acc = (x4 - x_sync) * d
    assert opt.state[p]["exp_avg"].item() == pytest.approx(-acc / (2 * lr), rel=1e-5)
    assert opt.state[p]["exp_avg"].item() == pytest.approx(
        ((m3 + wd * d * x_sync) + (m4 + wd * d * x3)) / 2, rel=1e-5
    )
    assert p.item() == pytest.approx(x_sync + acc / d, rel=1e-6)
    assert opt.state[p]["p_sync"].item() == p.item() and opt.global_state["lrs"] == [0.0]


def test_non_finite_gradient_on_a_local_step_drops_only_this_update():
    p = torch.nn.Parameter(torch.ones(3))
    opt = ZeroOneAdam(
        [p],
        lr=0.1,
        var_freeze_step=2,
        local_step_scaler=1,
        local_step_clipper=4,
        backend=SINGLE,
        bias_correction=False,  # SPEC §4's numbers
    )
    for _ in range(3):  # phase A, then the phase-B entry (a sync); the interval is now 2
        p.grad = torch.ones(3)
        opt.step()
    p.grad = torch.tensor([1.0, float("nan"), 1.0])  # step 4 … but 4 % 2 == 0: a sync step
    with pytest.warns(UserWarning, match="skipped on every rank"):
        opt.step()
    assert opt.global_state["step"] == 3  # a communicating step is skipped outright
    p.grad = torch.ones(3)
    opt.step()  # step 4, sync; interval 4 from now on
    state = (p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.global_state["lrs"])
    p.grad = torch.tensor([1.0, float("inf"), 1.0])  # step 5: purely local
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert len(caught) == 1 and "local update is dropped" in str(caught[0].message)
    assert torch.equal(p.detach(), state[0]) and torch.equal(opt.state[p]["exp_avg"], state[1])
    assert opt.global_state["step"] == 5 and opt.global_state["lrs"] == [state[2][0] + 0.1]
    assert opt.global_state["skipped_steps"] == 2
