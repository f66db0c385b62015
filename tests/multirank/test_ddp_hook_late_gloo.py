"""``OnebitHookState(opt, exchange_in_backward=False)``: the hook leaves the compression stage's
1-bit exchange to ``step()`` (no staged copies; docs/performance.md), the warmup's averages stay
in backward, and the results are the standalone optimizer's, bit for bit, for each optimizer,
with and without ``gradient_as_bucket_view``."""

from __future__ import annotations

import copy
import hashlib

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import commopt
import commopt.lightning
from tests.multirank.harness import run_ranks
from tests.multirank.test_ddp_hook_gloo import STEPS, _batch, _model
from tests.optim_registry import BY_NAME


def _train(backend, name: str, hook: str, view: bool) -> dict:
    plain = _model()
    model = (
        plain
        if hook == "none"
        else DistributedDataParallel(copy.deepcopy(plain), gradient_as_bucket_view=view)
    )
    opt = BY_NAME[name].make(model.parameters(), mode="ddp-hook", backward=True, backend=backend)
    if hook != "none":
        state = commopt.ddp.OnebitHookState(opt, exchange_in_backward=hook == "early")
        model.register_comm_hook(state, commopt.ddp.onebit_hook)
    digests, in_backward = [], 0
    for step in range(1, STEPS + 1):
        x, y = _batch(backend.rank, step)
        opt.zero_grad()
        before = opt.comm_stats()["compressed_rounds"]
        torch.nn.functional.mse_loss(model(x), y).backward()
        in_backward += opt.comm_stats()["compressed_rounds"] - before
        opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        digests.append(hashlib.sha1(flat.numpy().tobytes()).hexdigest()[:16])
    return {"digests": digests, "in_backward": in_backward}


@pytest.mark.parametrize("view", [False, True], ids=["copy", "bucket_view"])
@pytest.mark.parametrize("name", list(BY_NAME))
def test_late_exchange_equals_standalone(name: str, view: bool) -> None:
    late = run_ranks(_train, 2, name, "late", view, timeout=120)
    early = run_ranks(_train, 2, name, "early", view, timeout=120)
    alone = run_ranks(_train, 2, name, "none", False, timeout=120)
    assert [r["digests"] for r in late] == [r["digests"] for r in alone]
    assert [r["digests"] for r in early] == [r["digests"] for r in alone]
    assert late[0]["in_backward"] == 0 < early[0]["in_backward"]


def test_exchange_in_backward_must_be_a_bool_or_none() -> None:
    opt = commopt.OnebitAdam(torch.nn.Linear(2, 2).parameters(), freeze_step=1)
    with pytest.raises(TypeError, match="exchange_in_backward must be True, False or None"):
        commopt.ddp.OnebitHookState(opt, exchange_in_backward="no")


def test_the_default_follows_the_parameters_device() -> None:
    """None: late on CPU (measured faster there, docs/performance.md), in backward where the
    parameters are on a CUDA device; an explicit value is kept."""
    opt = commopt.OnebitAdam(torch.nn.Linear(2, 2).parameters(), freeze_step=1)
    assert commopt.ddp.OnebitHookState(opt).exchange_in_backward is False
    assert commopt.ddp.OnebitHookState(opt, exchange_in_backward=True).exchange_in_backward
    assert commopt.lightning.OnebitHookCallback().exchange_in_backward is None
    if torch.cuda.is_available():
        on_gpu = commopt.OnebitAdam(torch.nn.Linear(2, 2).cuda().parameters(), freeze_step=1)
        assert commopt.ddp.OnebitHookState(on_gpu).exchange_in_backward is True
