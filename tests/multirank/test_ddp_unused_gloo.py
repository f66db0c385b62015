"""The DDP hook with ``find_unused_parameters=True`` equals the standalone optimizer when a
parameter goes unused on some ranks. DDP writes a zero gradient for a parameter this rank did
not use; the standalone optimizer sees ``None`` there. In communicating steps the two agree (a
gradient missing on some ranks counts as zero: docs/optimizers.md). In 0/1 Adam's local steps
they did not: the zero gradient decayed the momentum and moved the parameter, ``None`` leaves it
alone. The hook now restores ``None`` for a parameter that had no gradient when its bucket
arrived, once DDP has finished, in the steps where the gradient stays local."""

from __future__ import annotations

import copy
import hashlib

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import commopt
from tests.multirank.harness import run_ranks
from tests.multirank.test_ddp_hook_gloo import _batch
from tests.optim_registry import BY_NAME

STEPS = 10


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(6, 8)
        self.head = torch.nn.Linear(8, 3)
        self.aux = torch.nn.Linear(8, 3)  # unused on rank 1 after step 4
        self.use_aux = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return self.head(h) + (self.aux(h) if self.use_aux else 0)


def _train(backend, name: str, hook: bool, view: bool = False) -> list[str]:
    torch.manual_seed(0)
    net = Net()
    model = net
    if hook:
        model = DistributedDataParallel(
            copy.deepcopy(net), find_unused_parameters=True, gradient_as_bucket_view=view
        )
        net = model.module
    opt = BY_NAME[name].make(model.parameters(), mode="ddp-hook", backward=True, backend=backend)
    if hook:
        model.register_comm_hook(
            commopt.ddp.OnebitHookState(opt, exchange_in_backward=True), commopt.ddp.onebit_hook
        )
    digests = []
    for step in range(1, STEPS + 1):
        net.use_aux = step <= 4 or backend.rank == 0
        x, y = _batch(backend.rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        digests.append(hashlib.sha1(flat.numpy().tobytes()).hexdigest()[:16])
    return digests


@pytest.mark.parametrize("view", [False, True], ids=["copy", "bucket_view"])
@pytest.mark.parametrize("name", list(BY_NAME))
def test_find_unused_parameters_equals_standalone(name: str, view: bool) -> None:
    hooked = run_ranks(_train, 2, name, True, view, timeout=120)
    alone = run_ranks(_train, 2, name, False, timeout=120)
    assert hooked == alone  # every step, both ranks (0/1 Adam's local steps are 7 and 9)
