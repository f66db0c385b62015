"""commopt.DiLoCo inside the mpiexec job, on MpiBackend: the device matrix (tests/diloco_matrix.py:
replicas identical after every sync, streaming with a sync in flight, exact resume) and
hierarchical islands on MPI's node and cross communicators (2 nodes × 2 ranks faked through
torchrun-style variables)."""

from __future__ import annotations

import torch

import commopt
from commopt.comm import MpiBackend
from tests.diloco_matrix import check_diloco, run_diloco


def test_matrix_on_mpi(mpi_backend: MpiBackend, allgather) -> None:
    check_diloco(allgather(run_diloco(mpi_backend)))


def test_hierarchical_islands_on_mpi(mpi_backend: MpiBackend, world, allgather, monkeypatch):
    rank, n = world
    monkeypatch.setenv("LOCAL_RANK", str(rank % 2))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_RANK", str(rank // 2))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
    opt = commopt.DiLoCo(
        torch.optim.Adam(model.parameters(), lr=1e-2),
        sync_every=4,
        topology="hierarchical",
        fp32_syncs=0,  # the hierarchical 1-bit exchange from the first sync
        backend=mpi_backend,
    )
    digests = []
    for step in range(1, 9):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 6, generator=g) + rank
        ((model(x) - x[:, :3]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        digests.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    everyone = allgather(torch.stack(digests))
    assert n == 4
    for k in range(8):
        assert torch.equal(everyone[0][k], everyone[1][k])  # one worker per node, every step
        assert torch.equal(everyone[2][k], everyone[3][k])
        synced = k in (3, 7)
        assert torch.equal(everyone[0][k], everyone[2][k]) == synced, k
