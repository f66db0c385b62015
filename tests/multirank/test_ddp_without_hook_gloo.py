"""A DistributedDataParallel model trained by a commopt optimizer without commopt's hook:
DDP averages every gradient at full precision, then the optimizer exchanges them again (more
traffic than DDP alone, another algorithm). The optimizer notices that the gradients it is
about to communicate are already identical on every rank and warns once, on rank 0, naming
``commopt.ddp.onebit_hook``. With the hook, or without DDP, it says nothing."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import commopt
from tests.multirank.harness import run_ranks
from tests.optim_registry import OPTIMIZERS

HINT = "commopt.ddp.onebit_hook"


def _train(backend, name: str, setup: str) -> list[str]:
    info = next(i for i in OPTIMIZERS if i.name == name)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    net = model if setup == "standalone" else DistributedDataParallel(model)
    opt = info.make(net.parameters(), backend=backend)
    if setup == "hook":
        net.register_comm_hook(
            commopt.ddp.OnebitHookState(opt, exchange_in_backward=True), commopt.ddp.onebit_hook
        )
    gen = torch.Generator().manual_seed(backend.rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(info.steps):
            opt.zero_grad()
            net(torch.randn(4, 5, generator=gen)).square().mean().backward()
            opt.step()
    return [str(w.message) for w in caught if HINT in str(w.message)]


@pytest.mark.parametrize("name", [i.name for i in OPTIMIZERS])
def test_ddp_without_the_hook_warns_once_on_rank_zero(name: str) -> None:
    got = run_ranks(_train, 2, name, "ddp-without-hook", timeout=120)
    assert len(got[0]) == 1 and "DistributedDataParallel without commopt's hook" in got[0][0]
    assert got[1] == []


@pytest.mark.parametrize("setup", ["hook", "standalone"])
def test_no_warning_with_the_hook_or_without_ddp(setup: str) -> None:
    for info in OPTIMIZERS:
        assert run_ranks(_train, 2, info.name, setup, timeout=120) == [[], []]


def _compression_log(backend) -> list[str]:
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("commopt")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    info = next(i for i in OPTIMIZERS if i.name == "OnebitAdam")
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 2)
    opt = info.make(model.parameters(), backend=backend)
    gen = torch.Generator().manual_seed(backend.rank)
    for _ in range(info.steps):
        opt.zero_grad()
        model(torch.randn(4, 5, generator=gen)).square().mean().backward()
        opt.step()
    return [r for r in records if "compression started" in r]


def test_compression_start_is_logged_once_on_rank_zero() -> None:
    freeze = next(i for i in OPTIMIZERS if i.name == "OnebitAdam").config["freeze_step"]
    got = run_ranks(_compression_log, 2, timeout=120)
    assert got == [
        [f"OnebitAdam: compression started at step {freeze + 1} (1-bit exchanges from now on)"],
        [],
    ]
