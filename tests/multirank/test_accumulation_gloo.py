"""Gradient accumulation costs no communication until step(); comm_stats and its logging."""

from __future__ import annotations

import logging

import pytest
import torch

import commopt
from tests.multirank.harness import run_ranks
from tests.optim_registry import BY_NAME

TIMEOUT = 180


def _accumulate(backend, name: str, micro: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    opt = BY_NAME[name].make(model.parameters())  # 6 steps: every phase-A kind
    during, at_step = [], []
    for step in range(1, 7):
        before = backend.stats.snapshot()
        opt.zero_grad()
        for k in range(micro):
            g = torch.Generator().manual_seed(1000 * step + 10 * backend.rank + k)
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
            (torch.nn.functional.mse_loss(model(x), y) / micro).backward()
        during.append((backend.stats - before).calls)
        mid = backend.stats.snapshot()
        opt.step()
        at_step.append((backend.stats - mid).calls)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out = torch.empty(2 * flat.numel())
    backend.all_gather(out, flat)
    return {"during": during, "at_step": at_step, "replicas": out.view(2, -1)}


@pytest.mark.parametrize("name", list(BY_NAME))
def test_backward_passes_communicate_nothing(name):
    results = run_ranks(_accumulate, 2, name, 3, timeout=TIMEOUT)
    for r in results:
        assert r["during"] == [0] * 6, r["during"]  # three backward passes: not one collective
        assert r["at_step"][0] > 0  # the first step (warmup / variance step) communicates
        assert torch.equal(r["replicas"][0], r["replicas"][1])


def _stats_and_log(backend):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(37))
    opt = commopt.OnebitAdam([w], lr=1e-2, freeze_step=2)
    records: list[str] = []

    class ToList(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    log = logging.getLogger(f"test.monitor.{backend.rank}")
    log.addHandler(ToList())
    log.setLevel(logging.INFO)
    handle = commopt.log_comm_stats(opt, every=2, log=log)
    errors, expected = [], []
    for step in range(1, 6):
        g = torch.Generator().manual_seed(step * 7 + backend.rank)
        opt.zero_grad()
        (w * torch.randn(37, generator=g)).sum().backward()
        if step > 2:  # compression: the reference ‖e_new‖/‖c‖, from the buffers themselves
            beta1 = 0.9
            x = beta1 * opt.state[w]["exp_avg"].clone() + (1 - beta1) * w.grad
            e_old = next(s.comm for s in opt.flat_states)["worker_error"].clone()
            c = e_old.clone()
            c[:37] += x
        opt.step()
        errors.append(opt.comm_stats()["compression_error"])
        if step > 2:
            e_new = next(s.comm for s in opt.flat_states)["worker_error"]
            expected.append(float(e_new.norm() / c.norm()))
    handle.remove()
    return {"errors": errors, "expected": expected, "records": records, "stats": opt.comm_stats()}


def test_comm_stats_and_logging():
    results = run_ranks(_stats_and_log, 2, timeout=TIMEOUT)
    for r in results:
        assert r["errors"][:2] == [None, None]  # warmup: no compressed call yet
        for got, want in zip(r["errors"][2:], r["expected"], strict=True):
            assert got == pytest.approx(want, rel=1e-4)
            assert 0.0 < got < 2**0.5
        stats = r["stats"]
        assert stats["full_precision_rounds"] == 2 and stats["compressed_rounds"] == 3
        assert stats["skipped_steps"] == 0
        assert stats["bytes_sent"] > 0 and stats["calls"] == sum(stats["calls_by_op"].values())
        assert stats["bytes_received"] == stats["bytes_sent"]
        assert len(r["records"]) == 2  # steps 2 and 4
        assert r["records"][0].startswith("OnebitAdam step 2: ")
        assert "compression error n/a" in r["records"][0]
        assert "rounds full/compressed 2/2" in r["records"][1]
        assert "compression error 0." in r["records"][1]


def test_log_comm_stats_checks_its_arguments():
    opt = commopt.OnebitAdam([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match=r"Invalid every: 0 \(must be a positive int"):
        commopt.log_comm_stats(opt, every=0)
    with pytest.raises(TypeError, match="needs a commopt optimizer with comm_stats"):
        commopt.log_comm_stats(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))
