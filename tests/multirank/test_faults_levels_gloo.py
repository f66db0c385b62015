"""A rank stalled inside any group commopt creates stops every other rank within the timeout.

The hierarchical exchange carves a node group and a cross-node group out of the user's one, an
overlap or a delayed DiLoCo sync opens a channel of its own, and DiLoCo's islands a node group:
each is a new process group, which gloo would otherwise give its 30-minute default. Four forked
ranks start through ``commopt.init(timeout=4)`` as two fake nodes of two; rank 1 stalls inside
one level (its level backend's collectives sleep) or stops stepping, and every other rank must
raise :class:`~commopt.faults.CollectiveError` within the timeout (plus slack for this machine).
The MPI counterpart is ``test_faults_mpi_launch.py``'s hierarchical case.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import time

import pytest
import torch

import commopt
from commopt.comm.shm_backend import shared_memory_usable
from tests.multirank.harness import free_port, run_fault_rank

TIMEOUT_S = 4.0
WORLD = 4
_COLLECTIVES = ("all_reduce", "all_gather", "all_to_all", "broadcast", "barrier")


def _stall(backend: object, out: str) -> None:
    """Make every collective of ``backend`` (this instance only) hang once entered."""

    def hang(*args, **kwargs):
        with open(os.path.join(out, "fault_time"), "w") as f:
            f.write(repr(time.time()))
        time.sleep(120)

    for name in (*_COLLECTIVES, "reduce_scatter_mean_"):
        if hasattr(backend, name):
            setattr(backend, name, hang)


def _train(rank: int, case: str, out: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    if case.startswith("diloco"):
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        delay = 1 if case == "diloco-channel" else 0
        topology = "hierarchical" if case == "diloco-node" else "flat"
        kw = dict(sync_every=2, delay=delay, topology=topology, fp32_syncs=0)  # 1 bit at once
        opt = commopt.DiLoCo(inner, **kw)
    else:
        topology = "flat" if case == "overlap-channel" else "hierarchical"
        opt = commopt.OnebitAdam(
            model.parameters(),
            lr=1e-3,
            freeze_step=2,
            topology=topology,
            overlap=case == "overlap-channel",
        )
    torch.manual_seed(1 + rank)  # every rank its own data (the same on all: DiLoCo would warn)
    for step in range(1, 40):
        if rank == 1 and step == 4:
            if case in ("local", "local-tcp"):
                _stall(opt.exchange.local_backend, out)
            elif case == "cross":
                _stall(opt.exchange.cross_backend, out)
            elif case == "diloco-node":
                _stall(opt._node_backend, out)
            else:  # a channel: this rank stops issuing collectives at all
                with open(os.path.join(out, "fault_time"), "w") as f:
                    f.write(repr(time.time()))
                time.sleep(120)
        opt.zero_grad()
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()


def _rank(rank: int, port: int, case: str, out: str, env: dict[str, str]) -> None:
    nodes = {"LOCAL_RANK": str(rank % 2), "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(rank // 2)}
    train = functools.partial(_train, rank, case, out)
    run_fault_rank(rank, WORLD, port, out, {**nodes, **env}, train, TIMEOUT_S)


def _run(
    tmp_path, case: str, envs: list[dict[str, str]], stalled: int | None = 1
) -> dict[int, str]:
    """Start the four ranks; wait for every rank but ``stalled``; their messages."""
    ctx = mp.get_context("fork")
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, port, case, str(tmp_path), envs[r]))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    survivors = [r for r in range(WORLD) if r != stalled]
    try:
        deadline = time.monotonic() + 120
        for r in survivors:
            procs[r].join(timeout=max(0.0, deadline - time.monotonic()))
        hung = [r for r in survivors if procs[r].exitcode is None]
        assert not hung, f"rank(s) {hung} still hang after 120 s"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    return {r: (tmp_path / f"rank{r}.txt").read_text() for r in survivors}


@pytest.mark.parametrize(
    "case",
    ["local", "local-tcp", "cross", "overlap-channel", "diloco-node", "diloco-channel"],
)
def test_a_rank_stalled_in_a_level_stops_every_other_rank(tmp_path, case):
    env = {"COMMOPT_SHARED_MEMORY": "0"} if case == "local-tcp" else {}
    messages = _run(tmp_path, case, [env] * WORLD)
    fault = float((tmp_path / "fault_time").read_text())
    for r, message in messages.items():
        assert message.startswith("CollectiveError:"), (r, message)
        assert "on rank " in message and "(torch backend)" in message, (r, message)
        waited = float((tmp_path / f"rank{r}_end").read_text()) - fault
        # Within the timeout; a rank of the other node may wait for one more level's timeout.
        assert waited < 2 * TIMEOUT_S + 10, (r, waited, message)


@pytest.mark.skipif(not shared_memory_usable(), reason="no writable /dev/shm on this host")
def test_ranks_of_a_node_that_disagree_on_shared_memory_are_refused(tmp_path):
    envs = [{"COMMOPT_SHARED_MEMORY": "0"} if r == 1 else {} for r in range(WORLD)]
    messages = _run(tmp_path, "local", envs, stalled=None)
    for r, message in messages.items():
        assert message.startswith("ValueError: the ranks of a node disagree on using shared"), (
            r,
            message,
        )
        assert "node of ranks [0, 1]: rank 0 True, rank 1 False" in message, message
        assert "node of ranks [2, 3]" not in message, message
