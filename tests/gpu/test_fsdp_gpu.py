"""commopt on FSDP2 with CUDA parameters and with ZeRO-Offload (``CPUOffloadPolicy``).

4 spawned ranks share one GPU over gloo (one GPU cannot host two NCCL ranks), on a 2 × 2
(replicate, shard) mesh. With ``CPUOffloadPolicy`` the parameter shards, their gradients and the
optimizer state live in host memory: forward and backward run on the GPU, the optimizer's step
on the CPU with commopt's numba kernels. Checks: the state is where it should be, the replicas
are bit-identical after every communicating step, and the loss goes down.

Skipped without a CUDA GPU (``CPUOffloadPolicy`` needs one: on a machine without a GPU the
parameters are on the host already, the ordinary CPU path that tests/multirank/test_fsdp_gloo.py
runs).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible to torch", allow_module_level=True)

from tests.multirank.harness import run_ranks
from tests.optim_registry import OPTIMIZERS

WORLD = 4
TIMEOUT = 600.0
STEPS = 12


def _train(backend, offload: bool):
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    import commopt.fsdp

    del backend
    torch.cuda.set_device(0)
    out = {}
    for info in OPTIMIZERS:
        mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 8))
        policy = {"offload_policy": CPUOffloadPolicy()} if offload else {}
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh["shard"], **policy)
        fully_shard(model, mesh=mesh["shard"], **policy)
        opt = info.make(list(model.parameters()), backward=True)
        sharding = commopt.fsdp.attach(model, opt, mesh)
        g = torch.Generator().manual_seed(dist.get_rank())
        x, y = torch.randn(32, 64, generator=g).cuda(), torch.randn(32, 8, generator=g).cuda()
        losses, same = [], []
        for _ in range(STEPS):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
            mine = torch.cat([p.to_local().detach().reshape(-1).cpu() for p in model.parameters()])
            every = [torch.empty_like(mine) for _ in range(sharding.replicate.world_size)]
            dist.all_gather(every, mine, group=sharding.replicate.group)
            same.append(all(torch.equal(e, mine) for e in every))
        devices = {str(t.device.type) for s in opt.flat_states for t in s.flat.values()}
        shard_devices = {p.to_local().device.type for p in model.parameters()}
        out[info.name] = {"losses": losses, "same": same, "state": devices, "shards": shard_devices}
    return out


@pytest.mark.parametrize("offload", [False, True], ids=["cuda-shards", "cpu-offload"])
def test_fsdp_on_a_gpu(offload: bool) -> None:
    results = run_ranks(_train, WORLD, offload, timeout=TIMEOUT, start="spawn")
    where = "cpu" if offload else "cuda"
    for info in OPTIMIZERS:
        communicating = {
            s for ph in info.phases(STEPS, backward=True) if ph.communicates for s in ph.steps
        }
        for result in results:
            r = result[info.name]
            assert r["state"] == {where} and r["shards"] == {where}, r
            assert all(r["same"][s - 1] for s in communicating), r["same"]
            assert r["losses"][-1] < r["losses"][0], r["losses"]
