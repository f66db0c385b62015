"""The Lightning callbacks: OnebitHookCallback refuses a module without exactly one commopt
optimizer; RankStateCheckpoint refuses one too, and warns of a checkpoint saved without it."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("lightning", reason="needs Lightning: pip install 'commopt[lightning]'")

from commopt.lightning import OnebitHookCallback, RankStateCheckpoint


class FakeDDP(torch.nn.parallel.DistributedDataParallel):
    def __init__(self) -> None:  # no process group needed: only the isinstance check matters
        torch.nn.Module.__init__(self)


def trainer_with(*optimizers: torch.optim.Optimizer) -> types.SimpleNamespace:
    strategy = types.SimpleNamespace(model=FakeDDP())
    return types.SimpleNamespace(strategy=strategy, optimizers=list(optimizers))


def test_no_commopt_optimizer_is_a_clear_error():
    plain = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match=r"exactly one commopt optimizer.*found: SGD"):
        OnebitHookCallback().on_fit_start(trainer_with(plain), None)


def test_without_ddp_the_callback_does_nothing():
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(model=torch.nn.Linear(2, 2)))
    callback = OnebitHookCallback()
    callback.on_fit_start(trainer, None)
    assert callback.state is None


def test_rank_state_checkpoint_needs_a_commopt_optimizer():
    plain = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    trainer = trainer_with(plain)
    trainer.default_root_dir, trainer.global_step = "unused", 3
    with pytest.raises(ValueError, match=r"RankStateCheckpoint needs exactly one.*found: SGD"):
        RankStateCheckpoint().on_save_checkpoint(trainer, torch.nn.Linear(2, 2), {})


def test_a_checkpoint_saved_without_rank_state_is_warned_of_and_nothing_is_loaded():
    callback = RankStateCheckpoint()
    with pytest.warns(UserWarning, match="this checkpoint was saved without it"):
        callback.on_load_checkpoint(trainer_with(), None, {"state_dict": {}})
    callback.on_train_start(trainer_with(), None)  # nothing to load: no optimizer looked up
