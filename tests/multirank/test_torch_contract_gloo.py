"""torch.optim's contract on 2 gloo ranks, where the 1-bit exchange runs (issue #38).

The one-process rows are ``tests/unit/test_torch_contract.py``; here the same fixes go through
the compressed exchange: lr = 0 in every phase, fp32 parameters under a float64 default dtype
(the exchange's buffers), and a deep copy that keeps training on the same backend.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.multirank.harness import run_ranks
from tests.optim_registry import OPTIMIZERS


def _train(backend, name: str, case: str):
    from tests.optim_registry import BY_NAME

    info = BY_NAME[name]
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(40, 3))
    start = w.detach().clone()
    gen = torch.Generator().manual_seed(backend.rank)

    def steps(opt, p, n):
        for _ in range(n):
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            opt.step()

    if case == "lr0":
        opt = info.make([w], lr=0.0)
        steps(opt, w, info.steps + 4)
        return torch.equal(w, start), w.detach().clone()
    if case == "float64-default":
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            opt = info.make([w])
            steps(opt, w, info.steps)  # ends on a communicating step
        finally:
            torch.set_default_dtype(previous)
        return w.dtype == torch.float32, w.detach().clone()
    opt = info.make([w])
    steps(opt, w, 3)
    twin = copy.deepcopy(opt)
    w2 = twin.param_groups[0]["params"][0]
    steps(twin, w2, info.steps - 3)  # the copy trains through every phase, same backend
    return w2 is not w, w2.detach().clone()


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("case", ["lr0", "float64-default", "deepcopy"])
def test_contract_on_two_ranks(info, case):
    (ok0, w0), (ok1, w1) = run_ranks(_train, 2, info.name, case, timeout=60)
    assert ok0 and ok1
    assert torch.equal(w0, w1)  # replicas identical


def _tiny_lr_group(backend, name: str):
    from tests.optim_registry import BY_NAME

    info = BY_NAME[name]
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(30))
    b = torch.nn.Parameter(torch.randn(30))
    start = b.detach().clone()
    opt = info.make([{"params": [a]}, {"params": [b], "lr": 1e-28}])
    gen = torch.Generator().manual_seed(backend.rank)
    for _ in range(info.steps):
        a.grad = torch.randn(30, generator=gen)
        b.grad = torch.randn(30, generator=gen)
        opt.step()
    return float((b.detach() - start).abs().max())


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_a_group_with_a_tiny_lr_barely_moves_in_every_phase(info):
    # test_param_groups_lr: 0/1 Adam on 2 ranks moved a group whose lr is 1e-28 by 0.05: its
    # sync compressed the lr-weighted updates of both groups with one 1-bit scale.
    moved = run_ranks(_tiny_lr_group, 2, info.name, timeout=60)
    assert max(moved) < 1e-20, moved


def _no_grad_steps(backend, name: str):
    from tests.optim_registry import BY_NAME

    info = BY_NAME[name]
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(20))
    opt = info.make([w])
    gen = torch.Generator().manual_seed(backend.rank)
    for t in range(info.steps + 3):
        if t in (0, 4):  # no gradient on any rank: not a step
            w.grad = None
        else:
            w.grad = torch.randn(20, generator=gen)
        opt.step()
    return opt.global_state["step"], w.detach().clone()


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_steps_without_any_gradient_are_not_counted(info):
    (s0, w0), (s1, w1) = run_ranks(_no_grad_steps, 2, info.name, timeout=60)
    assert s0 == s1 == info.steps + 1
    if info.communicates(info.steps + 1):
        assert torch.equal(w0, w1)


def _unfreeze_late(backend, name: str, mode: str):
    from tests.optim_registry import BY_NAME

    info = BY_NAME[name]
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))
    fresh_b = torch.nn.Parameter(b.detach().clone())
    opt = info.make([a, b], mode=mode)
    fresh = None
    gen = torch.Generator().manual_seed(100 + backend.rank)
    unfreeze = info.steps + 1
    same = []
    for t in range(1, 2 * info.steps + 2):
        b.requires_grad_(t >= unfreeze)
        x = torch.randn(5, generator=gen)
        loss = (a.sum(1) * x).sum() + ((b * b).sum() * x.sum() if t >= unfreeze else 0.0)
        if t == unfreeze:
            fresh = info.make([fresh_b], mode=mode)
        opt.zero_grad()
        loss.backward()  # (with overlap, b's hook starts work for the old buckets at t = unfreeze)
        if fresh is not None:
            fresh.zero_grad()
            ((fresh_b * fresh_b).sum() * x.sum()).backward()
            fresh.step()
        opt.step()
        same.append(torch.equal(b, fresh_b))
    return all(same), b.detach().clone(), a.detach().clone()


@pytest.mark.parametrize("info", [i for i in OPTIMIZERS if i.name != "ZeroOneAdam"], ids=repr)
@pytest.mark.parametrize("mode", ["standalone", "overlap"])
def test_a_layer_unfrozen_late_trains_like_a_fresh_optimizer_on_two_ranks(info, mode):
    (ok0, b0, a0), (ok1, b1, a1) = run_ranks(_unfreeze_late, 2, info.name, mode, timeout=60)
    assert ok0 and ok1
    assert torch.equal(b0, b1) and torch.equal(a0, a1)


def _compiled(backend, name: str, compiled: bool):
    from tests.optim_registry import BY_NAME

    info = BY_NAME[name]
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(40))
    opt = info.make([w])
    step = torch.compile(opt.step) if compiled else opt.step
    gen = torch.Generator().manual_seed(backend.rank)
    for _ in range(info.steps):
        w.grad = torch.randn(40, generator=gen)
        step()
    return w.detach().clone()


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_torch_compile_of_step_runs_the_step_as_it_is(info):
    # torch.compile(opt.step) failed deep in dynamo (numba's dispatcher, nonzero's dynamic
    # shape); the step is now opaque to dynamo (torch.compiler.disable): the same bits.
    eager = run_ranks(_compiled, 2, info.name, False, timeout=120)
    compiled = run_ranks(_compiled, 2, info.name, True, timeout=120)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


def _sit_out(backend, name: str, mode: str):
    from tests.optim_registry import BY_NAME

    info = BY_NAME[name]
    torch.manual_seed(0)
    a, b, c = (torch.nn.Parameter(torch.randn(n)) for n in (6, 7, 5))
    opt = info.make([a, b, c], mode=mode)
    gen = torch.Generator().manual_seed(100 + backend.rank)
    last = max(t for t in range(1, 2 * info.steps + 2) if info.communicates(t))
    for t in range(1, last + 1):  # (ends on a step that syncs the replicas)
        trains = t % 4 != 3  # b sits out steps 3, 7, 11, … on every rank
        b.requires_grad_(trains)
        x = torch.randn(6, generator=gen)
        loss = (a * x).sum() ** 2 + (c * x[:5]).sum() ** 2
        if trains:
            loss = loss + (b * x[0]).sum() ** 2
        opt.zero_grad()
        loss.backward()
        if backend.rank == 1 and t == 5:
            c.grad = None  # on one rank only: a zero gradient there, a step c does not sit out
        opt.step()
    counts = [{k: v for k, v in opt.state[p].items() if "idle" in k} for p in (a, b, c)]
    return torch.cat([a.detach(), b.detach(), c.detach()]), counts


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("mode", ["standalone", "overlap"])
def test_a_parameter_sitting_steps_out_counts_them_alike_on_every_rank(info, mode):
    # Each parameter counts its own steps (torch's state[p]["step"]): the steps it sat out
    # are counted on every rank alike, so the replicas stay identical; a gradient missing on
    # one rank only is a zero there, not a step sat out.
    (w0, n0), (w1, n1) = run_ranks(_sit_out, 2, info.name, mode, timeout=60)
    assert torch.equal(w0, w1)
    assert n0 == n1
    assert n0[0] == {} and n0[2] == {}
    if "bias_correction" in info.make([torch.nn.Parameter(torch.ones(1))]).defaults:
        assert n0[1]["idle_steps"] > 0
