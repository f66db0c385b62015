"""FSDP2 sharded inside a group of ranks, commopt's 1-bit exchange between the groups (HSDP).

    torchrun --nproc_per_node=4 examples/fsdp_hsdp.py --out /tmp/hsdp-run

On 4 ranks: 2 replicas × 2 shards (``--shards``). FSDP2 shards the model over the shard
dimension of the mesh (``mesh["shard"]``): each rank keeps half of every parameter, gradient and
optimizer state; ``commopt.fsdp.attach`` makes the optimizer average across the replicate
dimension, at full precision in warmup and at one bit after it (docs/fsdp.md). Trains a small
regression with each optimizer (``--optimizer``, default all three), saves a DCP checkpoint
halfway and, for the first optimizer, resumes from it in a fresh model and optimizer to check
the resume is bit-exact. Rank 0 writes ``result.json``.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import commopt

OPTIMIZERS = {
    "OnebitAdam": lambda p, f: commopt.OnebitAdam(p, lr=3e-3, freeze_step=f),
    "OnebitLamb": lambda p, f: commopt.OnebitLamb(p, lr=3e-2, freeze_step=f),
    "ZeroOneAdam": lambda p, f: commopt.ZeroOneAdam(p, lr=3e-3, var_freeze_step=f),
}


def build(name: str, mesh, freeze: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
    )
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    optimizer = OPTIMIZERS[name](model.parameters(), freeze)
    commopt.fsdp.attach(model, optimizer, mesh)
    return model, optimizer


def train(model, optimizer, steps: range, target: torch.Tensor) -> list[float]:
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())  # data differ by rank
        x = torch.randn(32, 16, generator=gen).to(target.device)
        loss = nn.functional.mse_loss(model(x), x @ target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def whole(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=[*OPTIMIZERS, "all"], default="all")
    parser.add_argument("--shards", type=int, default=2, help="S: ranks sharing one replica")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--freeze-step", type=int, default=15)
    parser.add_argument("--out", default="hsdp-run")
    parser.add_argument("--checkpoint", help="DCP directory (default: OUT/checkpoint)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    commopt.init()  # torchrun's environment; gloo on CPU, NCCL where there are GPUs
    world = dist.get_world_size()
    if args.shards < 1 or world % args.shards:
        parser.error(f"--shards {args.shards} must divide the number of ranks, {world}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    mesh = init_device_mesh(
        device, (world // args.shards, args.shards), mesh_dim_names=("replicate", "shard")
    )
    target = torch.randn(16, 1, generator=torch.Generator().manual_seed(0)).to(device)
    names = list(OPTIMIZERS) if args.optimizer == "all" else [args.optimizer]
    half = args.steps // 2
    ckpt = args.checkpoint or os.path.join(args.out, "checkpoint")  # (a shared file system)
    results = {}
    for i, name in enumerate(names):
        model, optimizer = build(name, mesh, args.freeze_step)
        losses = train(model, optimizer, range(half), target)
        if i == 0:
            commopt.fsdp.save_checkpoint(ckpt, model, optimizer)
        losses += train(model, optimizer, range(half, args.steps), target)
        entry = {
            "losses": losses,
            "comm_stats": {
                k: v for k, v in optimizer.comm_stats().items() if not isinstance(v, dict)
            },
            "exchange": optimizer.exchange.name,
        }
        if i == 0:  # resume in a fresh model and optimizer: the same second half, bit for bit
            model2, optimizer2 = build(name, mesh, args.freeze_step)
            commopt.fsdp.load_checkpoint(ckpt, model2, optimizer2)
            train(model2, optimizer2, range(half, args.steps), target)
            entry["resume_bit_exact"] = bool(torch.equal(whole(model), whole(model2)))
        results[name] = entry
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(
                {"world_size": world, "shards": args.shards, "optimizers": results}, f, indent=1
            )
    commopt.destroy_process_group()


if __name__ == "__main__":
    main()
