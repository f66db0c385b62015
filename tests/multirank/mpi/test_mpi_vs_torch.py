"""The same computations through MpiBackend and through TorchBackend (gloo) in one mpiexec job.

The TorchBackend comes from ``commopt.init()`` under mpiexec (no MASTER_ADDR: torch.distributed
is bootstrapped over MPI). Both backends only move bytes for the compressed allreduce, so its
results must agree bit for bit; replicas must agree bit for bit across ranks.
"""

from __future__ import annotations

import pytest
import torch

from commopt import OnebitAdam, broadcast_parameters, compressed_allreduce, padded_size
from commopt.comm import MpiBackend, TorchBackend
from commopt.compressed import compression_bytes

LENGTHS = [1, 37, 100, 1000, 4099]  # none a multiple of 8·n for n = 4 except by accident
CALLS = 4


def local_input(rank: int, length: int, call: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * call + 100 * rank + length)
    return torch.randn(length, generator=g) * (1 + rank) + 0.1 * call


def run_compressed(backend, rank: int, length: int) -> dict[str, list[torch.Tensor]]:
    """CALLS stateful compressed allreduces of this rank's inputs; outputs and final errors."""
    n = backend.world_size
    e = torch.zeros(padded_size(length, n))
    f = torch.zeros(padded_size(length, n) // n)
    outs, sent = [], []
    for call in range(CALLS):
        before = backend.stats.snapshot()
        outs.append(compressed_allreduce(local_input(rank, length, call), e, f, backend))
        sent.append((backend.stats - before).bytes_sent)
    return {"outputs": outs, "worker_error": [e], "server_error": [f], "sent": sent}


@pytest.mark.parametrize("length", LENGTHS)
def test_compressed_allreduce_same_over_mpi_and_gloo(
    mpi_backend: MpiBackend, torch_backend: TorchBackend, world, allgather, length: int
) -> None:
    rank, n = world
    over_mpi = run_compressed(mpi_backend, rank, length)
    over_gloo = run_compressed(torch_backend, rank, length)
    everyone = allgather(over_mpi["outputs"])

    for key in ("outputs", "worker_error", "server_error"):
        for call, (a, b) in enumerate(zip(over_mpi[key], over_gloo[key], strict=True)):
            assert torch.equal(a, b), f"rank {rank}: {key}[{call}] differs between MPI and gloo"
    for r, outs in enumerate(everyone):
        for call, (mine, theirs) in enumerate(zip(over_mpi["outputs"], outs, strict=True)):
            assert torch.equal(mine, theirs), f"call {call}: output on rank {r} != rank {rank}"
    for over in (over_mpi, over_gloo):  # the byte counter, per call, on both backends
        assert over["sent"] == [compression_bytes(length, n)] * CALLS
    # Sanity: the stateful calls did something (errors carried between calls, output non-zero).
    assert over_mpi["worker_error"][0].abs().sum() > 0
    assert all(o.shape == (length,) and o.abs().sum() > 0 for o in over_mpi["outputs"])


class TwoHeads(torch.nn.Module):
    """Two independent linear maps, so each weight's gradient depends on the data alone."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(7, 5)  # 40 parameters
        self.b = torch.nn.Linear(3, 3, bias=False)  # 9

    def forward(self, xa: torch.Tensor, xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(xa), self.b(xb)


def batch(rank: int, step: int) -> tuple[torch.Tensor, ...]:
    # Small integers: every gradient is an exact small integer, so the full-precision average
    # of the warmup is exact in fp32 whatever order MPI or gloo add in. Without that, the two
    # libraries' different summation orders would legitimately differ in the last bit.
    g = torch.Generator().manual_seed(1000 * step + rank)
    xa, xb = torch.randint(-3, 4, (4, 7), generator=g), torch.randint(-3, 4, (4, 3), generator=g)
    ca, cb = torch.randint(-3, 4, (4, 5), generator=g), torch.randint(-3, 4, (4, 3), generator=g)
    return xa.float(), xb.float(), ca.float(), cb.float()


def train(backend, rank: int, steps: int, freeze_step: int) -> tuple[list[torch.Tensor], dict]:
    torch.manual_seed(1234 + rank)  # replicas start different; broadcast makes them equal
    model = TwoHeads()
    broadcast_parameters(model, backend=backend)
    opt = OnebitAdam(model.parameters(), lr=0.05, freeze_step=freeze_step, backend=backend)
    for step in range(steps):
        xa, xb, ca, cb = batch(rank, step)
        opt.zero_grad()
        ya, yb = model(xa, xb)
        ((ya * ca).sum() + (yb * cb).sum()).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.comm_stats()


def test_onebit_adam_replicas_identical_and_same_over_mpi_and_gloo(
    mpi_backend: MpiBackend, torch_backend: TorchBackend, world, allgather
) -> None:
    rank, _n = world
    steps, freeze_step = 7, 3
    params_mpi, stats_mpi = train(mpi_backend, rank, steps, freeze_step)
    params_gloo, stats_gloo = train(torch_backend, rank, steps, freeze_step)
    everyone = allgather(params_mpi)
    torch.manual_seed(1234)
    start = [p.detach() for p in TwoHeads().parameters()]  # rank 0's initial replica

    for r, theirs in enumerate(everyone):
        for i, (mine, other) in enumerate(zip(params_mpi, theirs, strict=True)):
            assert torch.equal(mine, other), f"MPI replicas differ: parameter {i}, rank {r}"
    for i, (a, b) in enumerate(zip(params_mpi, params_gloo, strict=True)):
        assert torch.equal(a, b), f"parameter {i} differs between MPI and gloo on rank {rank}"
    assert all(not torch.equal(a, s) for a, s in zip(params_mpi, start, strict=True))  # trained
    for stats in (stats_mpi, stats_gloo):
        assert stats["full_precision_rounds"] == freeze_step
        assert stats["compressed_rounds"] == steps - freeze_step
