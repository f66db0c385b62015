"""commopt.fsdp inside the mpiexec job: FSDP2 (torch.distributed, gloo bootstrapped over MPI)
shards over the shard dimension; the optimizer's averages, 1-bit exchanges and per-tensor sums
go over MPI, through the world communicator split by replica and by shard. Bit for bit the same
as with the optimizer on torch's process groups: 2 replicas make every average a sum of two,
and the 1-bit exchange is the same bits on either backend."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import commopt.fsdp
from tests.optim_registry import OPTIMIZERS


def _train(backend, name: str) -> tuple[list[torch.Tensor], bool, int]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    info = next(i for i in OPTIMIZERS if i.name == name)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 30), nn.Tanh(), nn.Linear(30, 5))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    opt = info.make(list(model.parameters()), backward=True, backend=backend)
    sharding = commopt.fsdp.attach(model, opt, mesh)
    trace = []
    for step in range(1, info.steps + 3):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x = torch.randn(8, 12, generator=g)
        ((model(x) - x[:, :5]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        trace.append(
            torch.cat([p.to_local().detach().reshape(-1).clone() for p in model.parameters()])
        )
    from commopt.comm import MpiBackend

    on_mpi = isinstance(sharding.replicate, MpiBackend) and isinstance(sharding.shard, MpiBackend)
    return trace, on_mpi, opt.comm_stats()["compressed_rounds"]


@pytest.mark.parametrize("name", [info.name for info in OPTIMIZERS])
def test_sharded_over_mpi_equals_sharded_over_gloo(mpi_backend, torch_backend, allgather, name):
    on_mpi = _train(mpi_backend, name)
    on_gloo = _train(torch_backend, name)
    everyone = allgather((on_mpi, on_gloo))
    for (mpi_trace, mpi_kind, rounds), (gloo_trace, gloo_kind, _) in everyone:
        assert mpi_kind and not gloo_kind
        assert rounds > 0
        assert all(torch.equal(a, b) for a, b in zip(mpi_trace, gloo_trace, strict=True))
