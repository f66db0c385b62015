"""The DDP hook honours what the program does between backward and ``step()``, as
``overlap=True`` does (test_overlap_after_backward_gloo.py): in the steps where the hook folds
the local gradient during backward (1-bit Adam's and 1-bit LAMB's compression stage, 0/1 Adam's
1-bit steps), ``clip_grad_norm_`` on ``p.grad`` and a change of β1 (OneCycleLR's
``cycle_momentum``) used to be ignored, silently: the hook had already folded the unclipped
gradient with the old β1. Now ``step()`` sees the change, every rank agrees, and the step is
redone as the standalone optimizer would: the same bits, one warning on rank 0.

In the warmup the hook averages, and DDP leaves the average in ``p.grad``, so clipping there
acts on the averaged gradient, as with DDP and torch.optim (docs/ddp.md): the test clips only in
the steps that compress.
"""

from __future__ import annotations

import copy
import hashlib
import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import commopt
from tests.multirank.harness import run_ranks
from tests.multirank.test_ddp_hook_gloo import STEPS, _batch, _model
from tests.optim_registry import BY_NAME

WORLD = 2


def _compressed_steps(backend, name: str) -> list[int]:
    """Steps (from 1) in which the standalone optimizer ran a compressed exchange."""
    model = _model()
    opt = BY_NAME[name].make(model.parameters(), mode="ddp-hook", backward=True, backend=backend)
    steps = []
    for step in range(1, STEPS + 1):
        x, y = _batch(backend.rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        before = opt.comm_stats()["compressed_rounds"]
        opt.step()
        if opt.comm_stats()["compressed_rounds"] > before:
            steps.append(step)
    return steps


def _train(backend, name: str, hook: bool, habit: str, at: list[int], view: bool = False) -> dict:
    plain = _model()
    model = plain
    if hook:
        model = DistributedDataParallel(copy.deepcopy(plain), gradient_as_bucket_view=view)
    opt = BY_NAME[name].make(model.parameters(), mode="ddp-hook", backward=True, backend=backend)
    if hook:
        model.register_comm_hook(
            commopt.ddp.OnebitHookState(opt, exchange_in_backward=True), commopt.ddp.onebit_hook
        )
    digests = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, STEPS + 1):
            x, y = _batch(backend.rank, step)
            opt.zero_grad()
            (10 * torch.nn.functional.mse_loss(model(x), y)).backward()
            if step in at and habit == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
            elif step in at and habit == "beta1":
                for group in opt.param_groups:
                    group["betas"] = (0.8 + 0.01 * step, group["betas"][1])
            opt.step()
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            digests.append(hashlib.sha1(flat.numpy().tobytes()).hexdigest()[:16])
    redone = [str(w.message) for w in caught if "was redone as" in str(w.message)]
    return {
        "digests": digests,
        "redone": redone,
        "compressed": opt.comm_stats()["compressed_rounds"],
    }


@pytest.mark.parametrize("habit", ["clip", "beta1"])
@pytest.mark.parametrize("name", list(BY_NAME))
def test_ddp_hook_equals_standalone_under_the_habit(name: str, habit: str) -> None:
    at = run_ranks(_compressed_steps, WORLD, name, timeout=120)[0]
    assert at, "the schedule has no compressed step"
    hooked = run_ranks(_train, WORLD, name, True, habit, at, timeout=120)
    alone = run_ranks(_train, WORLD, name, False, habit, at, timeout=120)
    assert [r["digests"] for r in hooked] == [r["digests"] for r in alone]
    assert len(hooked[0]["redone"]) == 1 and "standalone" in hooked[0]["redone"][0]
    assert hooked[1]["redone"] == [] and alone[0]["redone"] == []
    # One exchange redone, at the first step that changed what the hook read; from then on
    # the hook leaves the exchange to step(): one extra exchange in the whole run, not one per step.
    assert hooked[0]["compressed"] == alone[0]["compressed"] + 1


@pytest.mark.parametrize("habit", ["clip", "beta1"])
def test_gradient_as_bucket_view_too(habit: str) -> None:
    at = run_ranks(_compressed_steps, WORLD, "OnebitAdam", timeout=120)[0]
    hooked = run_ranks(_train, WORLD, "OnebitAdam", True, habit, at, True, timeout=120)
    alone = run_ranks(_train, WORLD, "OnebitAdam", False, habit, at, timeout=120)
    assert [r["digests"] for r in hooked] == [r["digests"] for r in alone]
    assert len(hooked[0]["redone"]) == 1


def test_no_redo_under_the_hook_without_the_habit() -> None:
    for name in BY_NAME:
        for view in (False, True):  # gradient_as_bucket_view
            hooked = run_ranks(_train, WORLD, name, True, "none", [], view, timeout=120)
            assert hooked[0]["redone"] == [] and hooked[1]["redone"] == [], (name, view)
