"""The small MLP the FSDP2 GPU tests shard on a 2 × 2 (replicate, shard) mesh."""

from __future__ import annotations

import torch
from torch import nn


def sharded_mlp(device: str, offload: bool):
    """(model, mesh): ``nn.Sequential(Linear(64, 96), GELU, Linear(96, 8))`` from seed 0, each
    Linear and then the whole model ``fully_shard``-ed over ``mesh["shard"]``, with
    ``CPUOffloadPolicy`` when ``offload``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 8))
    policy = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["shard"], **policy)
    fully_shard(model, mesh=mesh["shard"], **policy)
    return model, mesh


def train(model, opt, device: str, steps: int, replicate) -> tuple[list[float], list[bool]]:
    """``steps`` steps of MSE on this rank's fixed batch; per step the loss and whether this
    rank's shards equal those of every rank of ``replicate`` (a commopt ``TorchBackend``) after
    it (gathered on the host)."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(32, 64, generator=g).to(device), torch.randn(32, 8, generator=g).to(device)
    losses, same = [], []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        mine = torch.cat([p.to_local().detach().reshape(-1).cpu() for p in model.parameters()])
        every = [torch.empty_like(mine) for _ in range(replicate.world_size)]
        dist.all_gather(every, mine, group=replicate.group)
        same.append(all(torch.equal(e, mine) for e in every))
    return losses, same
