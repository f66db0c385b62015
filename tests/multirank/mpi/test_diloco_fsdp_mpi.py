"""commopt.DiLoCo over FSDP2 shards inside the mpiexec job, its syncs over MPI.

FSDP2 shards over torch.distributed (gloo, bootstrapped over MPI); the outer sync goes over an
``MpiBackend`` on the world communicator split by shard index, so that its ranks hold the same
shard: the MPI twin of ``mesh.get_group("replicate")``. With 2 replicas every average is a sum of
two and the 1-bit exchange is the same bits on either backend, so the run equals the one whose
sync goes over the replicate process group, bit for bit. A communicator whose ranks hold
different shards is refused on every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import commopt

H, STEPS, D = 4, 12, 16


def _sharded():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    return model, mesh


def _train(backend_for, compression: str) -> tuple[list[torch.Tensor], dict]:
    import torch.distributed as dist

    rank = dist.get_rank()
    model, mesh = _sharded()
    backend = backend_for(mesh)
    opt = commopt.DiLoCo(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        sync_every=H,
        compression=compression,
        fp32_syncs=1,
        backend=backend,
    )
    trace = []
    for step in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, D, generator=g) + 0.5 * rank
        ((model(x) - x[:, :4].sin()) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        trace.append(
            torch.cat([p.to_local().detach().reshape(-1).clone() for p in model.parameters()])
        )
    return trace, opt.comm_stats()


def _mpi_replicate(mesh):
    from mpi4py import MPI

    from commopt.comm import MpiBackend

    world = MPI.COMM_WORLD
    # rank = replica * 2 + shard on the (2, 2) mesh: the ranks of one shard index, in replica order
    return MpiBackend(world.Split(world.Get_rank() % 2, world.Get_rank() // 2))


@pytest.mark.parametrize("compression", ["none", "onebit"])
def test_sync_over_mpi_equals_sync_over_the_replicate_group(torch_backend, allgather, compression):
    on_mpi, mpi_stats = _train(_mpi_replicate, compression)
    on_gloo, gloo_stats = _train(
        lambda mesh: commopt.TorchBackend(mesh.get_group("replicate")), compression
    )
    everyone = allgather((on_mpi, on_gloo, mpi_stats["sync_bytes"], gloo_stats["sync_bytes"]))
    for mpi_trace, gloo_trace, mpi_bytes, gloo_bytes in everyone:
        assert all(torch.equal(a, b) for a, b in zip(mpi_trace, gloo_trace, strict=True))
        assert mpi_bytes == gloo_bytes > 0
    # replicas of one shard (ranks r and r + 2) are one model after every sync
    for r in (0, 1):
        for step in range(H - 1, STEPS, H):
            assert torch.equal(everyone[r][0][step], everyone[r + 2][0][step])
        assert not torch.equal(everyone[r][0][H], everyone[r + 2][0][H])  # local steps differ


def test_a_communicator_across_shards_is_refused(torch_backend, allgather):
    from mpi4py import MPI

    from commopt.comm import MpiBackend

    model, _ = _sharded()
    world = MPI.COMM_WORLD
    across = MpiBackend(world.Split(world.Get_rank() // 2, world.Get_rank() % 2))  # one replica
    try:
        commopt.DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=H, backend=across)
        error = None
    except ValueError as e:
        error = str(e)
    for message in allgather(error):
        assert message is not None and "shard" in message, message
