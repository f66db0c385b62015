"""Lightning: a callback that pairs Lightning's DDP model with a commopt optimizer.

Lightning builds the optimizer in ``configure_optimizers`` *after* it has wrapped the model in
DistributedDataParallel, so the hook cannot be given to ``DDPStrategy(ddp_comm_hook=...)``: its
state is the optimizer, which does not exist yet when the strategy registers hooks. The
callback registers :func:`commopt.ddp.onebit_hook` at ``on_fit_start``, once both exist and
before the first backward pass::

    import lightning.pytorch as pl
    from commopt.lightning import OnebitHookCallback

    class Model(pl.LightningModule):
        def configure_optimizers(self):
            return commopt.OnebitAdam(self.parameters(), lr=1e-3, freeze_step=1000)

    trainer = pl.Trainer(strategy="ddp", devices=2, callbacks=[OnebitHookCallback()])

Without the callback, DDP averages the gradients in full precision and the optimizer warns that
it is being handed averaged gradients (docs/ddp.md). With one device (no DDP) the callback does
nothing and the optimizer communicates by itself, as it does outside Lightning.

With :class:`commopt.DiLoCo` from ``configure_optimizers`` the callback registers torch's
``noop_hook`` instead: the inner steps keep each rank's own gradients and DiLoCo averages the
pseudo-gradient every H steps. (``DDPStrategy(ddp_comm_hook=noop_hook)`` would do the same on
CUDA, but Lightning registers a strategy's hook only on CUDA devices; on CPU it is dropped and
DDP averages every step, which DiLoCo then warns of at its first sync.) At ``on_train_end`` it
calls ``DiLoCo.finish(module.buffers())``, so ``fit`` leaves one synced model on every rank
(BatchNorm's statistics averaged), and validation
during ``fit`` evaluates the model of the last sync (``DiLoCo.synced_weights()``), the same on
every rank, not each rank's own between syncs.

Under ``precision="16-mixed"`` / ``"bf16-mixed"`` the callback also puts
:class:`ClippingMixedPrecision` in place of Lightning's AMP plugin, which refuses
``gradient_clip_val`` for commopt's optimizers.

:class:`RankStateCheckpoint` adds every rank's own optimizer state to Lightning's checkpoints,
which hold rank 0's alone, and loads it back on resume.

Needs ``pip install lightning`` (``lightning.pytorch``, version 2.4 or newer).
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import warnings
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.nn.parallel import DistributedDataParallel

from commopt.checkpoint import load_checkpoint, save_checkpoint
from commopt.ddp import OnebitHookState, register_hook
from commopt.diloco import DiLoCo
from commopt.optim.base import CompressedOptimizer

__all__ = ["ClippingMixedPrecision", "OnebitHookCallback", "RankStateCheckpoint"]

_COMMOPT = (CompressedOptimizer, DiLoCo)


class OnebitHookCallback(Callback):
    """Registers :func:`commopt.ddp.onebit_hook` on Lightning's DDP model at ``on_fit_start``,
    paired with the module's one commopt optimizer; for a :class:`~commopt.DiLoCo`, torch's
    ``noop_hook`` (the gradients stay local), ``finish()`` at ``on_train_end``, and
    validation during ``fit`` on :meth:`~commopt.DiLoCo.synced_weights`: every rank evaluates
    the model of the last sync, and trains on from its own afterwards.

    Args:
        exchange_in_backward: passed to :class:`~commopt.ddp.OnebitHookState` (``None``, the
            default: in backward on CUDA, in ``step()`` elsewhere, where it was measured faster
            with ``DDPStrategy(gradient_as_bucket_view=True)``; docs/ddp.md).

    Raises:
        ValueError: under DDP, ``configure_optimizers`` returned no commopt optimizer, or more
            than one (DDP takes one communication hook per model).
    """

    def __init__(self, exchange_in_backward: bool | None = None) -> None:
        self.exchange_in_backward = exchange_in_backward
        self.state: OnebitHookState | None = None
        self._synced: contextlib.ExitStack | None = None  # open during validation (DiLoCo)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Under ``precision="16-mixed"`` or ``"bf16-mixed"``, Lightning's AMP plugin in its
        :class:`ClippingMixedPrecision` form, so that ``gradient_clip_val`` clips a commopt
        optimizer's gradients (Lightning's own refuses to)."""
        plugin = trainer.strategy.precision_plugin
        if type(plugin) is MixedPrecision:  # (a plugin of the user's own is left as it is)
            trainer.strategy.precision_plugin = ClippingMixedPrecision(
                plugin.precision, plugin.device, plugin.scaler
            )

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Register the hook on the strategy's DDP model, paired with its commopt optimizer."""
        model: Any = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            return
        opt = _the_commopt_optimizer(trainer, "OnebitHookCallback")
        self.state = register_hook(model, opt, self.exchange_in_backward)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """For a :class:`~commopt.DiLoCo`: :meth:`~commopt.DiLoCo.finish` (collective), its
        buffers (BatchNorm's statistics) averaged too, so the model that ``fit`` leaves on
        every rank is the one model, synced, whatever step it ended at."""
        if not isinstance(trainer.strategy.model, DistributedDataParallel):
            return
        opt = _the_commopt_optimizer(trainer, "OnebitHookCallback")
        if isinstance(opt, DiLoCo):
            opt.finish(pl_module.buffers())

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A :class:`~commopt.DiLoCo`'s anchors in the parameters (outside ``fit`` there is no
        optimizer, and nothing changes)."""
        dilocos = [opt for opt in trainer.optimizers if isinstance(opt, DiLoCo)]
        if len(dilocos) == 1 and self._synced is None:
            self._synced = contextlib.ExitStack()
            self._synced.enter_context(dilocos[0].synced_weights())

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Each rank's own parameters back, bit for bit."""
        if self._synced is not None:
            self._synced.close()
            self._synced = None


class ClippingMixedPrecision(MixedPrecision):
    """Lightning's AMP plugin (``precision="16-mixed"`` / ``"bf16-mixed"``), which treats a
    commopt optimizer as it treats ``torch.optim.Adam``: with fp16 its gradients are unscaled
    after the closure (so ``on_before_optimizer_step`` sees them unscaled), and
    ``gradient_clip_val`` clips them, where Lightning's own raises "does not allow for gradient
    clipping because it performs unscaling of gradients internally".

    commopt's optimizers and :class:`~commopt.DiLoCo` declare ``_step_supports_amp_scaling``,
    as fused Adam does, so that ``GradScaler.step`` calls ``step()`` on every rank, even one
    whose gradients overflowed (skipping it there would leave the other ranks waiting in the
    exchange). Lightning reads that flag as "the optimizer unscales inside ``step()``": it
    leaves the gradients scaled and refuses to clip, with bf16 too, where nothing is scaled.
    They take an unscaled gradient as well (``GradScaler.step`` then hands ``step()`` its
    verdict without a scale), so here they are unscaled as any optimizer's. Other optimizers
    get Lightning's behaviour. :class:`OnebitHookCallback` installs it in place of
    Lightning's at ``setup``.
    """

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Any, **kwargs: Any
    ) -> Any:
        """Lightning's step under a GradScaler, with a commopt optimizer's gradients unscaled
        after the closure, unless the training step returned None (Lightning then skips)."""
        if self.scaler is None or not isinstance(optimizer, _COMMOPT):
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        skipped = closure_result is None and model.automatic_optimization
        if not skipped:
            self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if skipped:
            return closure_result
        step_output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return step_output

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Lightning's clipping; a commopt optimizer's gradients are unscaled by then."""
        if isinstance(optimizer, _COMMOPT):
            Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)
        else:
            super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)


class RankStateCheckpoint(Callback):
    """Each rank's own optimizer state beside every Lightning checkpoint, loaded back on resume.

    Lightning writes the checkpoint file from rank 0, with rank 0's ``optimizer.state_dict()``,
    and loads that on every rank: the other ranks would resume with zero error-feedback buffers
    (commopt warns and resets them rather than load rank 0's) and, under
    :class:`~commopt.DiLoCo`, with rank 0's weights and inner state between syncs. This callback
    writes :func:`commopt.save_checkpoint` (collective: every rank's own part) to
    ``dirpath/step-<global step>`` whenever Lightning saves a checkpoint, records that folder in
    the checkpoint, and on ``trainer.fit(ckpt_path=...)`` loads it at ``on_train_start``, after
    Lightning's own restore: the resumed run starts from every rank's own weights and optimizer
    state, bit for bit (examples/lightning_commopt.py, ``--resume-check``)::

        trainer = pl.Trainer(strategy="ddp", callbacks=[OnebitHookCallback(),
                                                        RankStateCheckpoint()])

    Each save writes a folder of its own (``step-<N>``, then ``step-<N>-2`` for a second save at
    the same step, such as ``last.ckpt``'s), and a folder goes when Lightning deletes the
    checkpoint that names it: on every save and at the end of ``fit``, rank 0 reads which
    folder each checkpoint file in a ``ModelCheckpoint``'s ``dirpath`` names, and removes the
    folders that a file it read named and none names now (a checkpoint ``save_top_k`` dropped,
    or a ``last.ckpt`` overwritten). A folder named by a checkpoint saved elsewhere
    (``trainer.save_checkpoint(path)``) is never removed.

    Args:
        dirpath: where the per-rank folders go; ``None``: ``<default_root_dir>/commopt-state``.
            Every rank must see it (one machine, or a shared file system).
        prune: remove the folders as above; ``False`` keeps every one.
    """

    key = "commopt_rank_state"

    def __init__(self, dirpath: str | os.PathLike[str] | None = None, prune: bool = True) -> None:
        self.dirpath = dirpath
        self.prune = prune
        self._resume_from: str | None = None
        self._named = _NamedFolders()
        self._saves: collections.Counter[int] = collections.Counter()  # saves per global step

    def _root(self, trainer: Trainer) -> str:
        if self.dirpath is not None:
            return os.fspath(self.dirpath)
        return os.path.join(trainer.default_root_dir, "commopt-state")

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Save every rank's state (Lightning calls this on every rank) and record where."""
        step = trainer.global_step
        self._saves[step] += 1  # (every rank counts alike) a folder per save, never shared:
        again = f"-{self._saves[step]}" if self._saves[step] > 1 else ""  # (e.g. last.ckpt)
        path = os.path.join(self._root(trainer), f"step-{step}{again}")
        save_checkpoint(path, pl_module, _the_commopt_optimizer(trainer, "RankStateCheckpoint"))
        checkpoint[self.key] = path
        if self.prune and trainer.is_global_zero:
            self._named.prune(trainer, self.key, self._root(trainer), keep=path)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Remove what the last save's clean-up left unnamed (ModelCheckpoint deletes the old
        files after writing the new one, so after this callback's last ``on_save_checkpoint``)."""
        if self.prune and trainer.is_global_zero:
            self._named.prune(trainer, self.key, self._root(trainer), keep=None)

    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Remember the folder; Lightning restores the optimizer after this hook."""
        self._resume_from = checkpoint.get(self.key)
        if self._resume_from is None:
            warnings.warn(
                "commopt.lightning.RankStateCheckpoint: this checkpoint was saved without it; "
                "the ranks resume from what Lightning loads (rank 0's optimizer state, the "
                "others' error buffers at zero)",
                stacklevel=2,
            )

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Load every rank's own state over what Lightning restored from rank 0's file."""
        if self._resume_from is not None:
            opt = _the_commopt_optimizer(trainer, "RankStateCheckpoint")
            load_checkpoint(self._resume_from, pl_module, opt)
            self._resume_from = None


class _NamedFolders:
    """Which per-rank folder each Lightning checkpoint file names, as read by rank 0."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[float, str | None]] = {}  # file → (its mtime, its folder)
        self.seen: set[str] = set()  # folders some file was read to name

    def prune(self, trainer: Trainer, key: str, root: str, keep: str | None) -> None:
        """Read the new or rewritten checkpoint files; remove the folders under ``root`` that a
        file read named and none names now (nothing, if a file cannot be read yet)."""
        present = set()
        for callback in trainer.checkpoint_callbacks:
            folder = getattr(callback, "dirpath", None)
            if folder and os.path.isdir(folder):
                ext = getattr(callback, "FILE_EXTENSION", ".ckpt")
                present |= {os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(ext)}
        for file in present:
            mtime = os.path.getmtime(file)
            if self.files.get(file, (None,))[0] != mtime:
                try:
                    named = torch.load(file, map_location="cpu", weights_only=False, mmap=True)
                except Exception:  # being written, or not a checkpoint: decide next time
                    return
                self.files[file] = (mtime, named.get(key) if isinstance(named, dict) else None)
        for file in set(self.files) - present:
            del self.files[file]
        named_now = {folder for _, folder in self.files.values() if folder is not None}
        self.seen |= named_now
        real_root = os.path.realpath(root)
        for folder in sorted(self.seen - named_now - {keep}):
            self.seen.discard(folder)
            inside = os.path.commonpath([os.path.realpath(folder), real_root]) == real_root
            if inside and os.path.isdir(folder):
                shutil.rmtree(folder)


def _the_commopt_optimizer(trainer: Trainer, who: str) -> CompressedOptimizer | DiLoCo:
    ours = [opt for opt in trainer.optimizers if isinstance(opt, _COMMOPT)]
    if len(ours) != 1:
        found = ", ".join(type(opt).__name__ for opt in trainer.optimizers) or "none"
        raise ValueError(
            f"{who} needs exactly one commopt optimizer (OnebitAdam, OnebitLamb, "
            f"ZeroOneAdam, DiLoCo) from configure_optimizers; found: {found}"
        )
    return ours[0]
