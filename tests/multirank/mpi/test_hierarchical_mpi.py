"""HierarchicalExchange inside the mpiexec job: MPI levels, gloo levels and mixed levels agree.

The 4 ranks of the job run on one host; 2 nodes × 2 ranks are faked through torchrun-style
variables passed as ``env``. Level backends carved from MpiBackend (comm.Split) and from the
gloo TorchBackend (dist.new_group) only move bytes, so every combination must give the same
bits; and every rank must hold the same output.
"""

from __future__ import annotations

import torch

from commopt import padded_size
from commopt.comm import MpiBackend, TorchBackend
from commopt.exchange import FlatExchange, HierarchicalExchange, build_exchange
from commopt.exchange.levels import build_level_backends
from commopt.exchange.topology import discover_topology

CALLS = 3
LENGTH = 4099


def fake_env(rank: int) -> dict[str, str]:
    return {"LOCAL_RANK": str(rank % 2), "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(rank // 2)}


def run(exchange, rank: int, length: int = LENGTH) -> list[torch.Tensor]:
    state = {k: torch.zeros(v) for k, v in exchange.state_numels(length).items()}
    outs = []
    for call in range(CALLS):
        g = torch.Generator().manual_seed(100 * rank + call)
        x = torch.randn(length, generator=g) * (1 + rank)
        exchange.allreduce_(x, state)
        outs.append(x)
    return [*outs, state["worker_error"], state["server_error"]]


def test_mpi_gloo_and_mixed_levels_agree(
    mpi_backend: MpiBackend, torch_backend: TorchBackend, world, allgather
) -> None:
    rank, _ = world
    topo = discover_topology(mpi_backend, fake_env(rank))
    mpi_local, mpi_cross = build_level_backends(mpi_backend, topo)
    torch_local, torch_cross = build_level_backends(torch_backend, topo)
    results = {
        "mpi": run(HierarchicalExchange(mpi_backend, topo), rank),
        "gloo": run(HierarchicalExchange(torch_backend, topo), rank),
        "mpi inside, gloo across": run(
            HierarchicalExchange(
                torch_backend, topo, local_backend=mpi_local, cross_backend=torch_cross
            ),
            rank,
        ),
        "gloo inside, mpi across": run(
            HierarchicalExchange(
                mpi_backend, topo, local_backend=torch_local, cross_backend=mpi_cross
            ),
            rank,
        ),
    }
    everyone = allgather([t.numpy() for t in results["mpi"][:CALLS]])
    assert topo.nodes == ((0, 1), (2, 3)) and mpi_local.world_size == 2
    for name, tensors in results.items():
        for a, b in zip(tensors, results["mpi"], strict=True):
            assert torch.equal(a, b), f"rank {rank}: {name} differs from MPI levels"
    for r, outs in enumerate(everyone):
        for call in range(CALLS):
            assert (outs[call] == everyone[0][call]).all(), f"call {call}: rank {r} differs"
    assert results["mpi"][CALLS].numel() == padded_size(LENGTH, 4) // 2  # one slice


def test_comm_type_shared_one_node_is_flat(mpi_backend: MpiBackend, world) -> None:
    topo = discover_topology(mpi_backend, {})
    exchange = build_exchange(mpi_backend, "hierarchical", env={})
    auto = build_exchange(mpi_backend, "auto", env={})
    hier, flat = run(exchange, world[0]), run(FlatExchange(mpi_backend), world[0])
    assert (topo.source, topo.num_nodes, topo.local_size) == ("mpi-shared", 1, 4)
    assert type(auto) is FlatExchange
    for a, b in zip(hier, flat, strict=True):
        assert torch.equal(a, b)


def test_in_stages_every_level_pair_gives_the_bits_of_one_stage(
    mpi_backend: MpiBackend, torch_backend: TorchBackend, world
) -> None:
    """``pipeline=3``: MPI's non-blocking cross collectives stay in flight while each stage is
    gathered inside the node (blocking, on the other level), with MPI or gloo on either level."""
    rank, _ = world
    length = 3 * 4 * 4096 - 13  # 3 stages per cross server chunk, the last one short, a pad
    topo = discover_topology(mpi_backend, fake_env(rank))
    levels = {
        "mpi": build_level_backends(mpi_backend, topo),
        "gloo": build_level_backends(torch_backend, topo),
    }
    one = run(HierarchicalExchange(mpi_backend, topo, pipeline=1), rank, length)
    for inside, across in (("mpi", "mpi"), ("gloo", "gloo"), ("mpi", "gloo"), ("gloo", "mpi")):
        staged = HierarchicalExchange(
            mpi_backend,
            topo,
            local_backend=levels[inside][0],
            cross_backend=levels[across][1],
            pipeline=3,
        )
        for a, b in zip(run(staged, rank, length), one, strict=True):
            assert torch.equal(a, b), f"rank {rank}: {inside} inside, {across} across differs"
