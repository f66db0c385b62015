"""ZeroOneAdam(bias_correction=True) on 4 forked gloo ranks: k is counted alike everywhere, so
v̂ and, after every communicating step, the parameters are bit-identical across ranks, with a
dead input (zero variance), a rare input (tiny variance, the step guard), and a param group added
in phase A; and the correction changes the run (it is applied)."""

from __future__ import annotations

import warnings

import torch

import commopt
from commopt.optim._zero_one import ZeroOneSchedule, frozen_denominator
from tests.multirank.harness import run_ranks

TIMEOUT = 300.0
STEPS = 24
FREEZE = 11  # variance steps 1, 2, 4, 6, 8, 10 (scaler 2); phase B from 12, syncs 12, 13, 14, 16…


def _denominator(opt, state):
    """√v̂ + ε of a bucket as 0/1 Adam's step reads it, after the variance updates so far."""
    k = ZeroOneSchedule(opt.global_state, opt.frozen_after, opt.config).variance_updates()
    return frozen_denominator(state, opt.param_groups, k)


def _run(backend, correct: bool) -> dict:
    warnings.simplefilter("ignore")
    rank = backend.rank
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 2))
    head = torch.nn.Linear(2, 2)
    opt = commopt.ZeroOneAdam(
        model.parameters(),
        lr=0.01,
        var_freeze_step=FREEZE,
        var_update_scaler=2,
        local_step_scaler=2,
        local_step_clipper=4,
        backend=backend,
        bias_correction=correct,
    )
    synced, denominators = [], []
    for t in range(1, STEPS + 1):
        if t == 5:
            opt.add_param_group({"params": head.parameters(), "lr": 0.02})
        gen = torch.Generator().manual_seed(100 * t + rank)
        x = torch.randn(16, 6, generator=gen)
        x[:, 3] = 0.0  # dead input: zero variance
        x[:, 5] = 0.0 if t < FREEZE else 3.0 * x[:, 5]  # rare input: tiny frozen variance
        if t == 2:
            x[0, 5] = 1e-4
        out = model(x)
        if t >= 5:
            out = head(out)
        opt.zero_grad()
        ((out - x[:, :2].sin()) ** 2).mean().backward()
        opt.step()
        if opt.global_state["lrs"] in ([], [0.0], [0.0, 0.0]):  # phase A, or just synced
            params = list(model.parameters()) + list(head.parameters())
            synced.append(torch.cat([p.detach().reshape(-1) for p in params]))
        denominators.append(torch.cat([_denominator(opt, s) for s in opt.flat_states]))
    return {
        "synced": synced,
        "d": denominators,
        "offsets": [g["variance_offset"] for g in opt.param_groups],
    }


def test_replicas_bit_identical_with_correction():
    on = run_ranks(_run, 4, True, timeout=TIMEOUT)
    off = run_ranks(_run, 4, False, timeout=TIMEOUT)
    assert len(on[0]["synced"]) > FREEZE  # phase A and several syncs
    for r in on[1:]:
        assert len(r["synced"]) == len(on[0]["synced"])
        for a, b in zip(on[0]["synced"], r["synced"], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(on[0]["d"], r["d"], strict=True):
            assert torch.equal(a, b)
    assert on[0]["offsets"] == [0, 3]  # variance steps 1, 2, 4 before the head joined
    assert all(torch.isfinite(s).all() for s in on[0]["synced"])
    # applied: the corrected denominator is larger (v̂ ≥ v), and the runs part
    assert (on[0]["d"][-1] >= off[0]["d"][-1]).all()
    assert (on[0]["d"][-1] > off[0]["d"][-1]).any()
    assert not torch.equal(on[0]["synced"][-1], off[0]["synced"][-1])
