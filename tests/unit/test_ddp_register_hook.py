"""commopt.ddp.register_hook picks the hook the optimizer needs and refuses what it cannot pair
(the hooks themselves run on real DDP models in tests/multirank)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

import commopt
from commopt.comm import SingleProcessBackend


class RecordingDDP(torch.nn.parallel.DistributedDataParallel):
    def __init__(self, module: torch.nn.Module | None = None) -> None:  # no process group
        torch.nn.Module.__init__(self)
        self.module = module or torch.nn.Linear(1, 1)
        self.parameters_to_ignore: set[str] = set()
        self.hooks: list[tuple[object, object]] = []

    def register_comm_hook(self, state: object, hook: object) -> None:  # type: ignore[override]
        self.hooks.append((state, hook))


def _params() -> list[torch.nn.Parameter]:
    return list(torch.nn.Linear(3, 2).parameters())


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))


def test_a_commopt_optimizer_gets_onebit_hook_paired_with_it():
    net = _net()
    opt = commopt.OnebitAdam(net[0].parameters(), freeze_step=2, backend=SingleProcessBackend())
    model = RecordingDDP(net)
    state = commopt.ddp.register_hook(model, opt)
    assert isinstance(state, commopt.ddp.OnebitHookState)
    assert model.hooks == [(state, commopt.ddp.onebit_hook)]
    # DDP's broadcast where torch's Join ends leaves the optimizer's parameters alone (they
    # are the optimizer's to keep: docs/ddp.md), and the others to DDP
    assert model.parameters_to_ignore == {"0.weight", "0.bias"}


def test_diloco_gets_torchs_noop_hook():
    net = _net()
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    opt = commopt.DiLoCo(inner, sync_every=2, backend=SingleProcessBackend())
    model = RecordingDDP(net)
    assert commopt.ddp.register_hook(model, opt) is None
    assert model.hooks == [(None, noop_hook)]
    assert model.parameters_to_ignore == {"0.weight", "0.bias", "1.weight", "1.bias"}


def test_what_it_cannot_pair_is_refused():
    sgd = torch.optim.SGD(_params(), lr=0.1)
    with pytest.raises(TypeError, match=r"got SGD \(pass the optimizer you built"):
        commopt.ddp.register_hook(RecordingDDP(), sgd)
    with pytest.raises(TypeError, match="needs a DistributedDataParallel model, got Linear"):
        commopt.ddp.register_hook(torch.nn.Linear(2, 2), sgd)
