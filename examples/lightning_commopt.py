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
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from collections.abc import Callable

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import commopt
from commopt.lightning import OnebitHookCallback

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


def standalone(name: str, freeze: int, data: TensorDataset) -> torch.Tensor:
    """The same training without Lightning or DDP: the optimizer communicates by itself."""
    net = make_model()
    opt = OPTIMIZERS[name](net.parameters(), freeze)
    for x, y in DataLoader(data, batch_size=16):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return flat(net)


def identical_everywhere(t: torch.Tensor) -> bool:
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    return all(torch.equal(everyone[0], other) for other in everyone)


def true_everywhere(flag: bool) -> bool:
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--freeze-step", type=int, default=10)
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--out", default="pl-run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")

    results = {}
    for name in args.optimizers.split(","):
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=int(os.environ.get("WORLD_SIZE", "1")),
            strategy="ddp",
            max_steps=args.steps,
            callbacks=[OnebitHookCallback()],
            use_distributed_sampler=False,  # each rank brings its own data (make_data)
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        module = Regression(name, args.freeze_step)
        data = make_data(trainer.global_rank, args.steps)
        trainer.fit(module, DataLoader(data, batch_size=16))
        weights = flat(module.net)
        stats = trainer.optimizers[0].comm_stats()
        results[name] = {
            "losses": module.losses,
            "replicas_identical": identical_everywhere(weights),
            "equals_standalone": true_everywhere(
                torch.equal(weights, standalone(name, args.freeze_step, data))
            ),
            "comm_stats": {k: v for k, v in stats.items() if not isinstance(v, dict)},
        }
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
