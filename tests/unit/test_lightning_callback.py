"""The Lightning callbacks: OnebitHookCallback refuses a module without exactly one commopt
optimizer; RankStateCheckpoint refuses one too, warns of a checkpoint saved without it, and
removes its folders with the checkpoints that name them (a real one-process fit on CPU)."""

from __future__ import annotations

import os
import types

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("lightning", reason="needs Lightning: pip install 'commopt[lightning]'")

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision

import commopt
from commopt.lightning import OnebitHookCallback, RankStateCheckpoint
from tests.diloco_matrix import one_rank_past_a_sync
from tests.optim_registry import OPTIMIZERS


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


class _Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.layer(x) - y) ** 2).mean()

    def configure_optimizers(self):
        return commopt.OnebitAdam(self.parameters(), lr=1e-2, freeze_step=2)


def _trainer(tmp_path, callbacks: list, **kw) -> Trainer:
    """One epoch on one CPU process, quiet."""
    quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)
    return Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        default_root_dir=tmp_path,
        callbacks=callbacks,
        **quiet,
        **kw,
    )


def _fit(tmp_path, steps: int, callbacks: list, ckpt_path=None) -> Trainer:
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(4 * steps, 4), torch.randn(4 * steps, 1)), 4)
    trainer = _trainer(tmp_path, callbacks)
    trainer.fit(_Tiny(), data, ckpt_path=ckpt_path)
    return trainer


def _folders(root) -> list[str]:
    return sorted(p.name for p in (root / "commopt-state").iterdir())


def test_rank_state_folders_go_with_the_checkpoints_that_name_them(tmp_path) -> None:
    """save_top_k=2 every 2 steps plus last.ckpt: the folders of the dropped checkpoints and of
    the overwritten last.ckpt go; the folder of a checkpoint saved by hand outside the
    ModelCheckpoint's dirpath stays, and a run resumes from it."""
    saver = ModelCheckpoint(
        dirpath=tmp_path / "ckpt",
        every_n_train_steps=2,
        save_top_k=2,
        monitor="step",
        mode="max",
        save_last=True,
    )

    class ByHand(Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step == 4:  # the step a ModelCheckpoint file also names
                trainer.save_checkpoint(tmp_path / "by-hand.ckpt")

    _fit(tmp_path, 10, [RankStateCheckpoint(), saver, ByHand()])
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == ["epoch=0-step=10.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]
    named = {
        torch.load(tmp_path / f, weights_only=False)[RankStateCheckpoint.key]
        for f in ["by-hand.ckpt", *(f"ckpt/{name}" for name in files)]
    }
    assert sorted(os.path.basename(f) for f in named) == _folders(tmp_path)
    # (Lightning runs ModelCheckpoint after the other callbacks: the save by hand came first)
    assert _folders(tmp_path) == ["step-10", "step-10-2", "step-4", "step-8"]
    _fit(tmp_path / "again", 10, [RankStateCheckpoint()], ckpt_path=tmp_path / "by-hand.ckpt")


def test_prune_false_keeps_every_folder(tmp_path) -> None:
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=1)
    _fit(tmp_path, 6, [RankStateCheckpoint(prune=False), saver])
    assert _folders(tmp_path) == ["step-2", "step-4", "step-6"]


def test_under_ddp_a_diloco_is_finished_at_the_end_of_fit() -> None:
    model, _, opt = one_rank_past_a_sync()
    OnebitHookCallback().on_train_end(trainer_with(opt), model)
    assert opt.progress.last_sync == [6] and opt.comm_stats()["syncs"] == 2


class _TinyDiLoCo(_Tiny):
    """H = 4 around SGD, validated every 3 steps; records the weight each validation saw, and
    the anchor then."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def configure_optimizers(self):
        from commopt.comm import SingleProcessBackend

        inner = torch.optim.SGD(self.parameters(), lr=0.05)
        return commopt.DiLoCo(inner, sync_every=4, backend=SingleProcessBackend())

    def validation_step(self, batch, batch_idx):
        opt = self.trainer.optimizers[0]
        if batch_idx == 0 and opt.progress.step > 0:
            anchor = opt.parts[0].views(opt.parts[0].anchor)[0]
            self.seen.append((self.layer.weight.detach().clone(), anchor.clone()))


def test_validation_during_fit_sees_the_synced_weights_and_changes_nothing(tmp_path) -> None:
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(40, 4), torch.randn(40, 1)), 4)
    ends = []
    for validate in (True, False):
        torch.manual_seed(1)
        module = _TinyDiLoCo()
        trainer = _trainer(
            tmp_path,
            [OnebitHookCallback()],
            enable_checkpointing=False,
            val_check_interval=3 if validate else None,
            limit_val_batches=1 if validate else 0,
            num_sanity_val_steps=0,
        )
        trainer.fit(module, data, data if validate else None)
        ends.append(module.layer.weight.detach().clone())
        if validate:  # steps 3, 6, 9: between syncs, where the own weights are not the anchor
            assert len(module.seen) == 3
            assert all(torch.equal(seen, anchor) for seen, anchor in module.seen)
    assert torch.equal(*ends)  # validating on the anchors left training as it was


CLIP = 0.5
SKIPPED = 3  # the batch whose training_step returns None: Lightning skips that step
_MAKERS = {info.name: lambda ps, info=info: info.make(ps, freeze=2) for info in OPTIMIZERS}
_MAKERS["DiLoCo"] = lambda ps: commopt.DiLoCo(torch.optim.AdamW(ps, lr=1e-2), sync_every=2)


def _clip_data() -> DataLoader:
    g = torch.Generator().manual_seed(0)  # targets ×10: gradients that the clipping cuts
    return DataLoader(
        TensorDataset(torch.randn(32, 4, generator=g), 10 * torch.randn(32, 1, generator=g)), 4
    )


def _largest_grad(params) -> float | None:
    grads = [p.grad for p in params if p.grad is not None]
    return max(float(g.abs().max()) for g in grads) if grads else None


class _Clipped(LightningModule):
    def __init__(self, name: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer, self.name, self.seen = torch.nn.Linear(4, 1), name, []

    def training_step(self, batch, batch_idx):
        if batch_idx == SKIPPED:
            return None
        x, y = batch
        return ((self.layer(x).float() - y) ** 2).mean()

    def on_before_optimizer_step(self, optimizer) -> None:
        self.seen.append(_largest_grad(self.parameters()))

    def configure_optimizers(self):
        return _MAKERS[self.name](self.parameters())


def _clipped_by_hand(name: str, precision: str, clip: float | None):
    """The loop Lightning runs, written out: autocast, GradScaler for fp16, unscale, clip; the
    weights and the largest gradient each step saw before the clipping."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 1)
    opt = _MAKERS[name](layer.parameters())
    scaler = torch.amp.GradScaler("cpu") if precision == "16-mixed" else None
    dtype = torch.float16 if precision == "16-mixed" else torch.bfloat16
    seen = []
    for i, (x, y) in enumerate(_clip_data()):
        if i == SKIPPED:  # Lightning: no backward; bf16 steps on no gradients, fp16 skips
            seen.append(None)
            if scaler is None:
                opt.step()
            continue
        with torch.autocast("cpu", dtype=dtype, cache_enabled=False):
            loss = ((layer(x).float() - y) ** 2).mean()
        (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        seen.append(_largest_grad(layer.parameters()))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(layer.parameters(), clip)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    return layer.weight.detach().clone(), seen


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("name", list(_MAKERS))
def test_gradient_clip_val_clips_a_commopt_optimizers_gradients_under_amp(
    tmp_path, name, precision
):
    """Lightning's AMP plugin refused ``gradient_clip_val`` with every commopt optimizer
    ("does not allow for gradient clipping because it performs unscaling of gradients
    internally", bf16 too) and showed ``on_before_optimizer_step`` fp16's scaled gradients;
    with the callback, the bits of the same loop written by hand, a skipped batch included."""
    module = _Clipped(name)
    # On CPU Lightning turns precision="16-mixed" into bf16; its plugin given by hand keeps
    # fp16 and a GradScaler, what precision="16-mixed" gives on a GPU.
    fp16 = {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    amp = fp16 if precision == "16-mixed" else {"precision": precision}
    trainer = _trainer(tmp_path, [OnebitHookCallback()], gradient_clip_val=CLIP, **amp)
    trainer.fit(module, _clip_data())
    assert type(trainer.precision_plugin).__name__ == "ClippingMixedPrecision"
    want, seen = _clipped_by_hand(name, precision, CLIP)
    assert torch.equal(module.layer.weight.detach(), want)
    assert list(map(str, module.seen)) == list(map(str, seen))  # unscaled, as Adam's (nan, inf)
    assert not torch.equal(want, _clipped_by_hand(name, precision, None)[0])  # it clipped
