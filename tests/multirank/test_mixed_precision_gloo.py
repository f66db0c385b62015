"""Mixed precision: bf16 with fp32 master weights, fp16-style loss scaling with
torch.amp.GradScaler (exact, and agreeing on an overflow seen by one rank only), fp16 autocast.
A non-finite gradient on one rank in every phase of every optimizer is checked by the shared
bodies (tests/multirank/common_bodies.py)."""

from __future__ import annotations

import pytest
import torch

from tests.multirank.harness import run_ranks
from tests.optim_registry import BY_NAME

TIMEOUT = 240

FREEZE = 4  # the last full-precision step: runs of 9 to 40 steps are mostly compressed


def _make(name: str, params, **overrides):
    return BY_NAME[name].make(params, freeze=FREEZE, **overrides)


def _problem(dtype: torch.dtype, rank: int, step: int):
    g = torch.Generator().manual_seed(50 * step + rank)
    x = torch.randn(32, 8, generator=g)
    w_true = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3) / 20 - 0.5
    return x.to(dtype), (x @ w_true).to(dtype)


def _gather(backend, t: torch.Tensor) -> torch.Tensor:
    t = t.detach().float().reshape(-1)
    out = torch.empty(backend.world_size * t.numel())
    backend.all_gather(out, t)
    return out.view(backend.world_size, -1)


# -- bf16 parameters with fp32 master weights ----------------------------------------------------
@pytest.mark.parametrize("name", list(BY_NAME))
def test_bf16_master_weights_are_the_fp32_algorithm(name):
    # One rank: the master weights of a bf16 model must be bit for bit what the same optimizer
    # does to fp32 parameters fed the same (bf16-computed) gradients, and the parameters their
    # bf16 rounding; through warmup and the compressed phase.
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3).to(torch.bfloat16)
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    opt = _make(name, model.parameters())
    ref_opt = _make(name, ref)
    for step in range(1, 10):
        x, y = _problem(torch.bfloat16, 0, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        for r, p in zip(ref, model.parameters(), strict=True):
            r.grad = p.grad.float()
        opt.step()
        ref_opt.step()
    for r, p in zip(ref, model.parameters(), strict=True):
        assert p.dtype == torch.bfloat16
        master = opt.state[p]["master"]
        assert master.dtype == torch.float32
        assert torch.equal(master, r.detach())
        assert torch.equal(p.detach(), r.detach().to(torch.bfloat16))
        for key, value in ref_opt.state[r].items():
            if torch.is_tensor(value) and value.is_floating_point():
                assert opt.state[p][key].dtype == value.dtype, key
                assert torch.equal(opt.state[p][key], value), key
    # The master copy is what lets small updates count: it holds bits bf16 cannot.
    assert any(
        not torch.equal(opt.state[p]["master"].to(torch.bfloat16).float(), opt.state[p]["master"])
        for p in model.parameters()
    )


def _run(backend, name: str, dtype: torch.dtype):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3).to(dtype)
    opt = _make(name, model.parameters())
    losses = []
    for step in range(1, 41):
        x, y = _problem(dtype, backend.rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    w = model.weight
    master = opt.state[w].get("master", w.detach())
    return {
        "losses": losses,
        "dtype": str(w.dtype),
        "master_dtype": str(master.dtype),
        "rounded": torch.equal(w.detach(), master.to(dtype)),
        "replicas": _gather(backend, torch.cat([p.reshape(-1) for p in model.parameters()])),
        "masters": _gather(backend, master),
    }


@pytest.mark.parametrize("name", list(BY_NAME))
def test_bf16_converges_and_replicas_stay_identical(name):
    assert BY_NAME[name].communicates(40, FREEZE)  # the last step: replicas agree
    fp32 = run_ranks(_run, 2, name, torch.float32, timeout=TIMEOUT)
    for r, r32 in zip(run_ranks(_run, 2, name, torch.bfloat16, timeout=TIMEOUT), fp32, strict=True):
        assert r["dtype"] == "torch.bfloat16" and r["master_dtype"] == "torch.float32"
        assert r["rounded"]
        first, last = sum(r["losses"][:4]) / 4, sum(r["losses"][-4:]) / 4
        last32 = sum(r32["losses"][-4:]) / 4
        assert last < 0.5 * first, (first, last)
        # about as good as fp32 (the bf16 forward pass itself is coarser)
        assert last < 1.3 * last32 + 0.01, (last, last32)
        assert torch.equal(r["replicas"][0], r["replicas"][1])
        assert torch.equal(r["masters"][0], r["masters"][1])


# -- loss scaling with GradScaler, and an inf on one rank ----------------------------------------
def _scaled_run(backend, name: str, use_scaler: bool, inf_step: int):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    opt = _make(name, model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16) if use_scaler else None
    scales = []
    for step in range(1, 13):
        x, y = _problem(torch.float32, backend.rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        (scaler.scale(loss) if scaler else loss).backward()
        if step == inf_step and backend.rank == 1:
            model.weight.grad[0, 0] = float("inf")  # an overflow on one rank only
        if scaler:
            scaler.step(opt)
            scaler.update()
            scales.append(float(scaler.get_scale()))
        else:
            opt.step()
    return {
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        "shared": BY_NAME[name].shared(opt, model.parameters(), FREEZE),
        "skipped": opt.comm_stats()["skipped_steps"],
        "step": opt.global_state["step"],
        "scales": scales,
    }


@pytest.mark.parametrize("name", list(BY_NAME))
def test_grad_scaler_is_exact_and_agrees_on_overflow(name):
    assert BY_NAME[name].communicates(6, FREEZE)  # (0/1 Adam: a sync) the skip is agreed
    # Scaling by a power of two and unscaling is exact, so scaler.step(opt) must reproduce the
    # unscaled run bit for bit — including the step skipped on both ranks for rank 1's inf.
    plain = run_ranks(_scaled_run, 2, name, False, 6, timeout=TIMEOUT)
    scaled = run_ranks(_scaled_run, 2, name, True, 6, timeout=TIMEOUT)
    for p, s in zip(plain, scaled, strict=True):
        assert torch.equal(p["params"], s["params"])
        assert p["skipped"] == s["skipped"] == 1
        assert p["step"] == s["step"] == 11
    assert torch.equal(scaled[0]["shared"], scaled[1]["shared"])
    # GradScaler's own bookkeeping stays local: only rank 1 saw the inf and backed off.
    assert scaled[0]["scales"][5] == 2.0**16 and scaled[1]["scales"][5] == 2.0**15


def _fp16_autocast_run(backend, name: str):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    opt = _make(name, model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=5)
    losses = []
    for step in range(1, 41):
        x, y = _problem(torch.float32, backend.rank, step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(float(loss.detach()))
    return {
        "losses": losses,
        "replicas": _gather(backend, BY_NAME[name].shared(opt, model.parameters(), FREEZE)),
    }


@pytest.mark.parametrize("name", list(BY_NAME))
def test_fp16_autocast_with_grad_scaler_converges(name):
    for r in run_ranks(_fp16_autocast_run, 2, name, timeout=TIMEOUT):
        first, last = sum(r["losses"][:4]) / 4, sum(r["losses"][-4:]) / 4
        assert last < 0.5 * first, (first, last)
        assert torch.equal(r["replicas"][0], r["replicas"][1])
