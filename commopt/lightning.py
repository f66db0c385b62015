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
DDP averages every step, which DiLoCo then warns of at its first sync.)

Needs ``pip install lightning`` (``lightning.pytorch``, version 2.4 or newer).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.nn.parallel import DistributedDataParallel

from commopt.ddp import OnebitHookState, onebit_hook
from commopt.diloco import DiLoCo
from commopt.optim.base import CompressedOptimizer

__all__ = ["OnebitHookCallback"]


class OnebitHookCallback(Callback):
    """Registers :func:`commopt.ddp.onebit_hook` on Lightning's DDP model at ``on_fit_start``,
    paired with the module's one commopt optimizer; for a :class:`~commopt.DiLoCo`, torch's
    ``noop_hook`` (the gradients stay local).

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

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Register the hook on the strategy's DDP model, paired with its commopt optimizer."""
        model: Any = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            return
        kinds = (CompressedOptimizer, DiLoCo)
        ours = [opt for opt in trainer.optimizers if isinstance(opt, kinds)]
        if len(ours) != 1:
            found = ", ".join(type(opt).__name__ for opt in trainer.optimizers) or "none"
            raise ValueError(
                "OnebitHookCallback needs exactly one commopt optimizer (OnebitAdam, OnebitLamb, "
                f"ZeroOneAdam, DiLoCo) from configure_optimizers; found: {found}"
            )
        if isinstance(ours[0], DiLoCo):
            model.register_comm_hook(None, noop_hook)
            return
        self.state = OnebitHookState(ours[0], self.exchange_in_backward)
        model.register_comm_hook(self.state, onebit_hook)
