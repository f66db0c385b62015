"""commopt.hf's callbacks outside a Trainer run: RankStateCheckpoint's refusals and its warning
(the bit-exact resume it gives is tests/multirank/test_hf_trainer.py); FinishDiLoCo's last
sync."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import commopt
from commopt.comm import SingleProcessBackend
from tests.diloco_matrix import one_rank_past_a_sync

pytest.importorskip("transformers", reason="needs the [hf] extra")

from commopt.hf import FinishDiLoCo, RankStateCheckpoint


def test_an_optimizer_that_is_not_commopts_is_refused():
    model = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    args, state = SimpleNamespace(output_dir="unused"), SimpleNamespace(global_step=5)
    with pytest.raises(TypeError, match="SGD, not a commopt optimizer"):
        RankStateCheckpoint().on_save(args, state, None, model=model, optimizer=sgd)


def test_a_resume_without_the_folder_warns_and_keeps_what_the_trainer_loaded(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = commopt.OnebitAdam(model.parameters(), freeze_step=2, backend=SingleProcessBackend())
    before = [p.detach().clone() for p in model.parameters()]
    args, state = SimpleNamespace(output_dir=str(tmp_path)), SimpleNamespace(global_step=7)
    with pytest.warns(UserWarning, match=r"no .*checkpoint-7.*commopt; the ranks resume from"):
        RankStateCheckpoint().on_train_begin(args, state, None, model=model, optimizer=opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_finish_diloco_syncs_the_steps_since_the_last_sync_and_ignores_other_optimizers():
    model, inner, opt = one_rank_past_a_sync()
    wrapped = SimpleNamespace(optimizer=opt)  # as accelerate's AcceleratedOptimizer holds it
    FinishDiLoCo().on_train_end(None, None, None, model=model, optimizer=wrapped)
    assert opt.progress.last_sync == [6] and opt.comm_stats()["syncs"] == 2
    FinishDiLoCo().on_train_end(None, None, None, model=model, optimizer=inner)  # nothing
