"""Lightning trains a LightningModule with each commopt optimizer through the DDP hook, 2 ranks.

    torchrun --nproc_per_node 2 examples/lightning_commopt.py --out /tmp/pl-run

``commopt.lightning.OnebitHookCallback`` registers ``commopt.ddp.onebit_hook`` on the model
Lightning wrapped in DistributedDataParallel, paired with the optimizer ``configure_optimizers``
returned; for ``commopt.DiLoCo`` (around AdamW, a sync every 5 steps) it registers torch's
``noop_hook``, so that DDP leaves the inner steps' gradients local. For each optimizer the same
model is then trained again without Lightning, by the standalone optimizer (which communicates
by itself), on the same data. Rank 0 writes ``result.json``: per optimizer the losses,
``comm_stats()``, whether the replicas are identical (0/1 Adam's are not between its sync
steps, by design) and whether Lightning's weights equal the standalone optimizer's on every
rank, bit for bit.

With ``--amp bf16`` or ``--amp fp16`` Lightning trains in mixed precision, and the standalone
run does the same by hand (torch.autocast, and a GradScaler for fp16); ``--clip C`` sets
``gradient_clip_val``, which Lightning's own AMP plugin refuses for commopt's optimizers and
the callback's ``ClippingMixedPrecision`` allows (docs/ddp.md).

With ``--resume-check``, for each optimizer also: a Lightning checkpoint after step 16, and a
new Trainer resumed from it, with and without ``commopt.lightning.RankStateCheckpoint``; the
result says whether the resumed run starts from the bits (weights and optimizer state) every
rank had at step 16. Lightning's file holds rank 0's optimizer state alone, so only the
callback gives the other ranks their own.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import warnings
from collections.abc import Callable

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

import commopt
from commopt.lightning import OnebitHookCallback, RankStateCheckpoint

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer | commopt.DiLoCo]] = {
    "OnebitAdam": lambda params, freeze: commopt.OnebitAdam(params, lr=1e-2, freeze_step=freeze),
    "OnebitLamb": lambda params, freeze: commopt.OnebitLamb(params, lr=1e-2, freeze_step=freeze),
    "ZeroOneAdam": lambda params, freeze: commopt.ZeroOneAdam(
        params, lr=1e-2, var_freeze_step=freeze, local_step_scaler=4
    ),
    # the callback registers torch's noop_hook for it: local inner steps, a sync every 5
    "DiLoCo": lambda params, freeze: commopt.DiLoCo(
        torch.optim.AdamW(params, lr=1e-2), sync_every=5
    ),
}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and in both runs
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def make_data(rank: int, steps: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(100)
    target = torch.randn(8, 1, generator=gen)
    gen.manual_seed(1 + rank)  # each rank its own samples
    x = torch.randn(16 * steps, 8, generator=gen)
    return TensorDataset(x, x @ target)


class Regression(pl.LightningModule):
    def __init__(self, name: str, freeze: int) -> None:
        super().__init__()
        self.net, self.name, self.freeze = make_model(), name, freeze
        self.losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer | commopt.DiLoCo:
        return OPTIMIZERS[self.name](self.parameters(), self.freeze)


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def grad_scaler(init_scale: float) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=init_scale)


def standalone(
    name: str, freeze: int, data: TensorDataset, amp: str = "none", init_scale: float = 2.0**16
) -> torch.Tensor:
    """The same training without Lightning or DDP: the optimizer communicates by itself (under
    ``amp``, in torch.autocast, and with fp16 through a GradScaler that the optimizer's step
    unscales for)."""
    net = make_model()
    opt = OPTIMIZERS[name](net.parameters(), freeze)
    scaler = grad_scaler(init_scale) if amp == "fp16" else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    for x, y in DataLoader(data, batch_size=16):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = torch.nn.functional.mse_loss(net(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return flat(net)


def identical_everywhere(t: torch.Tensor) -> bool:
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    return all(torch.equal(everyone[0], other) for other in everyone)


def true_everywhere(flag: bool) -> bool:
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _trainer(
    steps: int,
    callbacks: list[pl.Callback],
    amp: str = "none",
    clip: float = 0.0,
    init_scale: float = 2.0**16,
) -> pl.Trainer:
    # On CPU precision="16-mixed" means bf16; Lightning's plugin given by hand keeps fp16 and a
    # GradScaler, as precision="16-mixed" does on a GPU.
    fp16: dict = {"plugins": [MixedPrecision("16-mixed", "cpu", grad_scaler(init_scale))]}
    precision = (
        fp16 if amp == "fp16" else {"precision": "bf16-mixed" if amp == "bf16" else "32-true"}
    )
    return pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy="ddp",
        max_steps=steps,
        gradient_clip_val=clip or None,
        **precision,
        callbacks=[OnebitHookCallback(), *callbacks],
        use_distributed_sampler=False,  # each rank brings its own data (make_data)
        logger=False,
        enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def digest(module: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """SHA-256 of the weights and every tensor and value of ``opt.state_dict()``."""
    h = hashlib.sha256()

    def walk(x: object) -> None:
        if isinstance(x, torch.Tensor):
            h.update(x.detach().cpu().contiguous().numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(str(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())

    walk(flat(module))
    walk(opt.state_dict())
    return h.hexdigest()


class StateAt(pl.Callback):
    """The digest of this rank's weights and optimizer state after step ``step`` (the run that
    saves), or at ``on_train_start`` (a resumed run, after RankStateCheckpoint's load)."""

    def __init__(self, step: int) -> None:
        self.step, self.found = step, ""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        if trainer.global_step == self.step:
            self.found = digest(pl_module, trainer.optimizers[0])

    def on_train_start(self, trainer, pl_module) -> None:  # type: ignore[override]
        if trainer.global_step == self.step:
            self.found = digest(pl_module, trainer.optimizers[0])


def resume_check(name: str, freeze: int, out: str) -> dict[str, bool]:
    """A Lightning checkpoint after step 16 of 32 (1-bit Adam in its 1-bit stage, DiLoCo between
    syncs); then a new Trainer resumed from it, with and without RankStateCheckpoint. Whether
    the resumed run starts, on every rank, from the bits the saving run had at step 16: each
    rank's weights and optimizer state, error buffers included. (Not the end of the runs:
    Lightning's own resume at an epoch's end replays one batch.)"""
    from lightning.pytorch.callbacks import ModelCheckpoint

    folder = os.path.join(out, f"checkpoints-{name}")
    saver = ModelCheckpoint(dirpath=folder, every_n_epochs=1, save_top_k=-1)
    at_save = StateAt(16)
    trainer = _trainer(32, [RankStateCheckpoint(os.path.join(folder, "commopt")), at_save, saver])
    data = DataLoader(make_data(trainer.global_rank, 16), batch_size=16)
    trainer.fit(Regression(name, freeze), data)
    first_epoch = os.path.join(folder, "epoch=0-step=16.ckpt")
    equal = {}
    for label, callbacks in (("with_callback", [RankStateCheckpoint()]), ("without", [])):
        at_resume = StateAt(16)
        resumed = _trainer(17, [*callbacks, at_resume])  # its first step would be 17
        resumed.fit(Regression(name, freeze), data, ckpt_path=first_epoch)
        equal[label] = true_everywhere(at_resume.found == at_save.found != "")
    return equal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--freeze-step", type=int, default=10)
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--out", default="pl-run")
    parser.add_argument(
        "--amp",
        choices=["none", "bf16", "fp16"],
        default="none",
        help="Lightning's mixed precision (bf16-mixed, or fp16 with a GradScaler)",
    )
    parser.add_argument(
        "--init-scale",
        type=float,
        default=2.0**16,
        help="with --amp fp16, GradScaler's first scale (65536, its default); with one that "
        "overflows, the runs part: through the DDP hook one rank's inf reaches every rank in the "
        "averaged gradient and every rank's scale backs off, standalone only that rank's does",
    )
    parser.add_argument(
        "--clip",
        type=float,
        default=0.0,
        help="gradient_clip_val (then no standalone run: the hook's warmup clips the averaged "
        "gradient, the standalone optimizer each rank's own)",
    )
    parser.add_argument(
        "--resume-check", action="store_true", help="also resume from a checkpoint at step 16"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")

    results = {}
    for name in args.optimizers.split(","):
        trainer = _trainer(args.steps, [], args.amp, args.clip, args.init_scale)
        module = Regression(name, args.freeze_step)
        data = make_data(trainer.global_rank, args.steps)
        trainer.fit(module, DataLoader(data, batch_size=16))
        weights = flat(module.net)
        stats = trainer.optimizers[0].comm_stats()
        results[name] = {
            "losses": module.losses,
            "replicas_identical": identical_everywhere(weights),
            "equals_standalone": None
            if args.clip
            else true_everywhere(
                torch.equal(
                    weights, standalone(name, args.freeze_step, data, args.amp, args.init_scale)
                )
            ),
            "comm_stats": {k: v for k, v in stats.items() if not isinstance(v, dict)},
        }
        if args.resume_check:
            results[name]["resume_bit_exact"] = resume_check(name, args.freeze_step, args.out)
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"world_size": dist.get_world_size(), "optimizers": results}, f, indent=1)
    # Lightning created the process group and leaves it alive; end it before the interpreter
    # does, and through commopt: torch's call alone can deadlock gloo when the DDP model that
    # still holds the group is freed (docs/ddp.md, "Ending the run").
    commopt.destroy_process_group()


if __name__ == "__main__":
    main()
