"""Hugging Face Trainer: every rank's own optimizer state in the Trainer's checkpoints.

The Trainer saves rank 0's ``optimizer.state_dict()`` alone (``checkpoint-<step>/optimizer.pt``)
and loads that file on every rank when it resumes. For commopt's optimizers the other ranks then
resume with zero error-feedback buffers (commopt resets them, with a warning, rather than load
rank 0's), and under :class:`commopt.DiLoCo` also with rank 0's weights and inner state
between syncs. :class:`RankStateCheckpoint` adds each rank's own::

    from commopt.hf import RankStateCheckpoint

    trainer = Trainer(model=model, args=args, optimizers=(opt, sched),
                      callbacks=[RankStateCheckpoint()])
    trainer.train(resume_from_checkpoint=...)      # resumes bit for bit

:class:`FinishDiLoCo` ends a :class:`commopt.DiLoCo` run with its last sync, so that the model
the Trainer leaves and saves is the one synced model.

Needs ``pip install transformers`` (``pip install 'commopt[hf]'``). The DDP hook is registered
as in examples/hf_trainer_gpt2.py.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from transformers import TrainerCallback

from commopt.checkpoint import load_checkpoint, save_checkpoint
from commopt.diloco import DiLoCo
from commopt.optim.base import CompressedOptimizer

__all__ = ["FinishDiLoCo", "RankStateCheckpoint"]


def _commopt_optimizer(opt: Any) -> Any:
    return getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps ours


class FinishDiLoCo(TrainerCallback):
    """Calls :meth:`commopt.DiLoCo.finish` at ``on_train_end`` (collective; the Trainer calls
    it on every rank): the last sync of any inner steps since the previous one, and the
    model's floating-point buffers (BatchNorm's statistics) averaged, so the model that
    ``trainer.train()`` leaves, and ``trainer.save_model()`` writes, is the one synced model on
    every rank, whatever step training ended at. Does nothing for other optimizers."""

    def on_train_end(self, args, state, control, **kwargs):  # type: ignore[override]
        """``finish()`` the Trainer's DiLoCo."""
        opt = _commopt_optimizer(kwargs.get("optimizer"))
        if isinstance(opt, DiLoCo):
            model = kwargs.get("model")
            opt.finish(model.buffers() if model is not None else ())


class RankStateCheckpoint(TrainerCallback):
    """Writes :func:`commopt.save_checkpoint` (collective: every rank's own part) into
    ``checkpoint-<step>/commopt`` whenever the Trainer saves, and loads it when a resumed run
    begins, after the Trainer's own loads (tests/multirank/test_hf_trainer.py: bit-exact for
    DiLoCo mid-interval and for 1-bit Adam in its 1-bit stage).

    Args:
        model, optimizer: what to save; ``None``: the Trainer's model and optimizer (the commopt
            optimizer inside accelerate's ``AcceleratedOptimizer``).

    Raises:
        TypeError: the optimizer is not one of commopt's (at the first save or resume).
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: CompressedOptimizer | DiLoCo | None = None,
    ) -> None:
        self.model, self.optimizer = model, optimizer

    def _parts(
        self, kwargs: dict[str, Any]
    ) -> tuple[torch.nn.Module, CompressedOptimizer | DiLoCo]:
        model = self.model if self.model is not None else kwargs["model"]
        opt = self.optimizer if self.optimizer is not None else kwargs.get("optimizer")
        opt = _commopt_optimizer(opt)
        if not isinstance(opt, (CompressedOptimizer, DiLoCo)):
            raise TypeError(
                "commopt.hf.RankStateCheckpoint: the Trainer's optimizer is "
                f"{type(opt).__name__}, not a commopt optimizer; pass optimizers=(opt, sched)"
            )
        return model, opt

    @staticmethod
    def path(args: Any, state: Any) -> str:
        """``<output_dir>/checkpoint-<global step>/commopt``."""
        return os.path.join(args.output_dir, f"checkpoint-{state.global_step}", "commopt")

    def on_save(self, args, state, control, **kwargs):  # type: ignore[override]
        """Every rank's own state, beside the Trainer's files (the Trainer calls this on every
        rank)."""
        save_checkpoint(self.path(args, state), *self._parts(kwargs))

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[override]
        """On a resumed run (global step > 0), every rank's own state over rank 0's."""
        if state.global_step == 0:
            return
        path = self.path(args, state)
        if not os.path.isdir(path):  # resumed from elsewhere, or saved without this callback
            warnings.warn(
                f"commopt.hf.RankStateCheckpoint: no {path}; the ranks resume from what the "
                "Trainer loaded (rank 0's optimizer state, the others' error buffers at zero)",
                stacklevel=2,
            )
            return
        load_checkpoint(path, *self._parts(kwargs))
