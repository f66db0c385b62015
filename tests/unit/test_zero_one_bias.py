"""ZeroOneAdam(bias_correction=True): v̂ = v/(1 − β2^k), k = the variance updates v has had, and
m̂ = m/(1 − β1^t), t = the steps since the group joined.

Against a float64 re-statement written from the docs (docs/algorithms/zero_one_adam.md, "Bias
correction"), at n = 1 where the compressed allreduce is the identity; the update count against
SPEC §4's schedule; resume bit-exact, and checkpoints saved before the switch existed.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import commopt
from commopt import ZeroOneAdam
from commopt.optim._zero_one import ZeroOneSchedule, frozen_denominator
from commopt.optim.adam import (
    variance_bias_sqrt,
    variance_steps_through,
    variance_updates,
)
from tests.unit.test_zero_one_adam import spec_schedule

SINGLE = commopt.SingleProcessBackend()
SCHED = dict(var_freeze_step=9, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)


@pytest.mark.parametrize("scaler", [1, 2, 3, 16])
def test_update_count_follows_the_spec_schedule(scaler):
    variance, _ = spec_schedule(200, scaler, 1, 1, 200)
    for step in range(0, 201):
        assert variance_steps_through(step, scaler) == sum(t <= step for t in variance)
    # and the count read from the schedule state (I_v, counter) agrees at every step
    p = torch.nn.Parameter(torch.ones(2))
    opt = ZeroOneAdam([p], var_freeze_step=200, var_update_scaler=scaler, backend=SINGLE)
    for step in range(1, 201):
        p.grad = torch.ones(2)
        opt.step()
        gs = opt.global_state
        got = variance_updates(gs["var_interval"], gs["var_counter"], scaler)
        assert got == sum(t <= step for t in variance), step


def _denominator(opt, state):
    """√v̂ + ε of a bucket as 0/1 Adam's step reads it, after the variance updates so far."""
    k = ZeroOneSchedule(opt.global_state, opt.frozen_after, opt.config).variance_updates()
    return frozen_denominator(state, opt.param_groups, k)


def test_bias_factor():
    assert variance_bias_sqrt(0.999, 38, True) == math.sqrt(1 - 0.999**38)
    assert variance_bias_sqrt(0.999, 38, False) == 1.0
    assert variance_bias_sqrt(0.999, 0, True) == 1.0  # no update yet: v = 0, nothing to scale
    with pytest.raises(ValueError, match="power of 2"):
        variance_updates(3, 0, 2)


class Reference64:
    """SPEC §4 at n = 1 in float64, with v̂ = v/(1 − β2^k) and m̂ = m/(1 − β1^t) (k: the
    parameter's variance updates; t: in phase A its own steps, in phase B its param group's),
    and s = Σ η/(1 − β1^t) over the local steps so that m ← −a/s recovers m, not m̂; written
    from the docs, not from the optimizer. A gradient of None in phase A: the parameter sits
    the step out, as in torch.optim (nothing changes, nothing counts)."""

    def __init__(self, lr, betas, eps, wd, freeze, scaler, local_scaler, clipper):
        self.hp = (lr, betas, eps, wd)
        self.variance, self.sync = spec_schedule(freeze, scaler, local_scaler, clipper, 10**4)
        self.freeze, self.t, self.p_sync = freeze, 0, None
        self.groups: list[dict] = []

    def add_group(self, params):
        self.groups.append(
            {
                "p": [q.detach().double().clone() for q in params],
                "m": [torch.zeros(q.shape, dtype=torch.float64) for q in params],
                "v": [torch.zeros(q.shape, dtype=torch.float64) for q in params],
                "k": [0] * len(params),
                "own_t": [0] * len(params),
                "t": 0,
                "lrs": 0.0,
            }
        )

    def _d(self, group):
        _, (_, b2), eps, _ = self.hp
        return [
            (v / (1 - b2**k if k else 1.0)).sqrt() + eps
            for v, k in zip(group["v"], group["k"], strict=True)
        ]

    def step(self, grads):
        lr, (b1, b2), _, wd = self.hp
        self.t += 1
        variance = self.t in self.variance
        if self.t > self.freeze and self.p_sync is None:
            self.p_sync = [[q.clone() for q in g["p"]] for g in self.groups]
        phase_b = self.t > self.freeze
        for group, gs in zip(self.groups, grads, strict=True):
            group["t"] += 1
            group_size = lr / (1 - b1 ** group["t"])
            sizes = []
            for i, g in enumerate(gs):
                sizes.append(None if g is None else group_size)
                if g is None:
                    assert not phase_b, "the reference sits steps out in phase A only"
                    continue
                group["k"][i] += variance
                group["own_t"][i] += 1
                if not phase_b:
                    sizes[i] = lr / (1 - b1 ** group["own_t"][i])
                g = g.double()
                group["m"][i] = b1 * group["m"][i] + (1 - b1) * g
                if variance:
                    group["v"][i] = b2 * group["v"][i] + (1 - b2) * g * g
            d = self._d(group)
            for i, q in enumerate(group["p"]):
                if sizes[i] is not None:
                    group["p"][i] = q - sizes[i] * group["m"][i] / d[i] - lr * wd * q
            if phase_b:
                group["lrs"] += group_size
        if self.t > self.freeze and self.t in self.sync:
            for j, group in enumerate(self.groups):
                d = self._d(group)
                for i in range(len(group["p"])):
                    acc = (group["p"][i] - self.p_sync[j][i]) * d[i]
                    group["m"][i] = -acc / group["lrs"]
                    group["p"][i] = self.p_sync[j][i] + acc / d[i]
                    self.p_sync[j][i] = group["p"][i].clone()
                group["lrs"] = 0.0


def test_whole_run_matches_float64_reference_with_a_group_added_later():
    gen = torch.Generator().manual_seed(0)
    first = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(4, 3), (3,)]]
    later = [torch.nn.Parameter(torch.randn(5, generator=gen))]
    hp = dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
    opt = ZeroOneAdam(first, backend=SINGLE, bias_correction=True, step_guard=False, **hp, **SCHED)
    ref = Reference64(0.01, (0.8, 0.99), 1e-6, 0.05, 9, 2, 2, 4)
    ref.add_group(first)
    groups = [first]
    for t in range(1, 26):
        if t == 4:  # after step 3 (variance steps 1, 2 so far); step 4 is a variance step
            opt.add_param_group({"params": later})
            ref.add_group(later)
            groups.append(later)
            assert opt.param_groups[1]["variance_offset"] == 2
        grads = [[torch.randn(q.shape, generator=gen) for q in g] for g in groups]
        for g, gg in zip(groups, grads, strict=True):
            for q, x in zip(g, gg, strict=True):
                q.grad = x.clone()
        opt.step()
        ref.step(grads)
        for g, rg in zip(groups, ref.groups, strict=True):
            for i, q in enumerate(g):
                torch.testing.assert_close(q.detach().double(), rg["p"][i], atol=1e-6, rtol=1e-5)
                torch.testing.assert_close(
                    opt.state[q]["exp_avg_sq"].double(), rg["v"][i], atol=1e-9, rtol=1e-6
                )
    # k: variance steps 1, 2, 4, 6, 8 of T_v = 9; the later group had 4, 6, 8
    assert [g["k"] for g in ref.groups] == [[5, 5], [3]]


def test_a_parameter_sitting_out_phase_a_steps_counts_its_own_updates():
    # torch counts each parameter's steps: one that sat out steps 3-5 (variance step 4
    # among them) has had 4 variance updates, not 5, and its m̂ counts its own steps. Before,
    # both counted every step of its group.
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(4, 3), (3,)]]
    hp = dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
    opt = ZeroOneAdam(params, backend=SINGLE, bias_correction=True, step_guard=False, **hp, **SCHED)
    ref = Reference64(0.01, (0.8, 0.99), 1e-6, 0.05, 9, 2, 2, 4)
    ref.add_group(params)
    for t in range(1, 26):
        grads = [torch.randn(q.shape, generator=gen) for q in params]
        if t in (3, 4, 5):
            grads[1] = None
        for q, g in zip(params, grads, strict=True):
            q.grad = None if g is None else g.clone()
        opt.step()
        ref.step([grads])
        for i, q in enumerate(params):
            torch.testing.assert_close(
                q.detach().double(), ref.groups[0]["p"][i], atol=1e-6, rtol=1e-5
            )
    assert ref.groups[0]["k"] == [5, 4]
    assert opt.state[params[1]]["idle_steps"] == 3
    assert opt.state[params[1]]["idle_variance_steps"] == 1


def test_first_step_is_adams_and_k_freezes_with_v():
    """Step 1: v̂ = ḡ², m̂ = ḡ, so p moves by η·sign(ḡ) (ε = 0), as Adam's first step; after the
    freeze the denominator no longer changes (k stops with v)."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    opt = ZeroOneAdam(
        [p],
        lr=0.1,
        betas=(0.9, 0.999),
        eps=0.0,
        var_freeze_step=3,
        var_update_scaler=1,
        backend=SINGLE,
        bias_correction=True,
    )
    p.grad = torch.tensor([4.0, -0.5, 1e-3])
    before = p.detach().clone()
    opt.step()
    torch.testing.assert_close(before - p.detach(), 0.1 * torch.sign(p.grad))
    for _ in range(6):
        p.grad = torch.randn(3)
        opt.step()
    state = opt.flat_states[0]
    d1 = _denominator(opt, state).clone()
    p.grad = torch.randn(3)
    opt.step()
    assert torch.equal(_denominator(opt, state), d1)
    # k = 2 variance updates (steps 1, 2; var_update_scaler 1: then 4 > T_v = 3)
    v = opt.state[p]["exp_avg_sq"]
    torch.testing.assert_close(d1, (v / (1 - 0.999**2)).sqrt())


def _train(opt, params, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for q in params:
            q.grad = torch.randn(q.shape, generator=gen)
        opt.step()


def _make(bias_correction=True, **kw):
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(6, 2), (4,)]]
    opt = ZeroOneAdam(params, lr=0.01, backend=SINGLE, bias_correction=bias_correction, **SCHED)
    return opt, params


@pytest.mark.parametrize("at", [3, 5, 9, 12])  # phase A (variance / 1-bit), last A, phase B
def test_resume_is_bit_exact(at):
    opt, params = _make()
    _train(opt, params, at, 0)
    sd = copy.deepcopy(opt.state_dict())
    saved = [q.detach().clone() for q in params]
    _train(opt, params, 10, 1)
    opt2, params2 = _make()
    with torch.no_grad():
        for q, s in zip(params2, saved, strict=True):
            q.copy_(s)
    opt2.load_state_dict(sd)
    _train(opt2, params2, 10, 1)
    for a, b in zip(params, params2, strict=True):
        assert torch.equal(a, b)


def _strip_new_keys(sd):
    """A state dict as the code before ``bias_correction`` saved it."""
    sd = copy.deepcopy(sd)
    for group in sd["param_groups"]:
        del group["bias_correction"], group["variance_offset"]
    return sd


@pytest.mark.parametrize("constructed_with", [False, True])
def test_old_checkpoint_resumes_uncorrected(constructed_with):
    """A checkpoint without the switch was trained with v as it is; it resumes so, bit for bit,
    whatever the new optimizer was constructed with (saved group options win, as in torch)."""
    opt, params = _make(bias_correction=False)
    _train(opt, params, 5, 0)
    sd = _strip_new_keys(opt.state_dict())
    saved = [q.detach().clone() for q in params]
    _train(opt, params, 10, 1)
    opt2, params2 = _make(bias_correction=constructed_with)
    with torch.no_grad():
        for q, s in zip(params2, saved, strict=True):
            q.copy_(s)
    opt2.load_state_dict(sd)
    assert [g["bias_correction"] for g in opt2.param_groups] == [False]
    _train(opt2, params2, 10, 1)
    for a, b in zip(params, params2, strict=True):
        assert torch.equal(a, b)


def test_old_checkpoint_gets_the_update_offset_of_a_group_added_later():
    opt, params = _make()
    _train(opt, params, 5, 0)  # variance steps 1, 2, 4
    extra = torch.nn.Parameter(torch.ones(3))
    opt.add_param_group({"params": [extra]})
    assert opt.param_groups[1]["variance_offset"] == 3
    sd = _strip_new_keys(opt.state_dict())
    opt2, _ = _make()
    opt2.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})
    opt2.load_state_dict(sd)
    assert [g["variance_offset"] for g in opt2.param_groups] == [0, 3]
