"""The two levels of :class:`commopt.exchange.HierarchicalExchange`: building and checking them.

A hierarchical exchange needs one backend per level: the L ranks of this node (local level) and
local rank j of every node (cross level). :func:`build_level_backends` carves both out of the
global backend, collectively; :func:`check_level_backends` verifies, on every rank alike, that
level backends (built here or given by the user) hold the ranks the topology says.

The local level's path decides how fast the exchange is on a CPU host (docs/hierarchical.md):
with ``shared_memory`` a TorchBackend's node group is wrapped in a
:class:`~commopt.comm.shm_backend.SharedMemoryBackend`; ``"auto"`` (the default everywhere,
including the optimizers' ``topology="hierarchical"``) does so for gloo, where the alternative is
TCP loopback, and can be turned off with ``COMMOPT_SHARED_MEMORY=0``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

import torch
import torch.distributed as dist

from commopt.comm import Backend, MpiBackend, TorchBackend
from commopt.comm.shm_backend import SharedMemoryBackend, shared_memory_usable
from commopt.exchange.topology import Topology
from commopt.faults import group_timeout, watch_like

__all__ = ["SharedMemory", "build_level_backends", "check_level_backends", "wants_shared_memory"]

SharedMemory = bool | Literal["auto"]
_ENV = "COMMOPT_SHARED_MEMORY"


def wants_shared_memory(
    backend: Backend, shared_memory: SharedMemory, env: Mapping[str, str] | None = None
) -> bool:  # env: os.environ when None (a parameter for tests)
    """Whether the local level carved from ``backend`` goes through shared memory.

    ``True``/``False`` say so; ``"auto"`` means: yes for a gloo TorchBackend (CPU tensors, the
    node's ranks otherwise talk over TCP loopback) on a host with a usable /dev/shm, unless the
    environment variable ``COMMOPT_SHARED_MEMORY`` is ``0`` (``1`` forces it for gloo). The
    answer depends only on the backend and the environment, which every rank of a node shares;
    the nodes need not agree (each node's local level is its own).
    """
    if shared_memory not in (True, False, "auto"):
        raise ValueError(f"Invalid shared_memory: {shared_memory!r} (True, False or 'auto')")
    if shared_memory != "auto":
        return bool(shared_memory)
    if not (isinstance(backend, TorchBackend) and backend.engine == "gloo"):
        return False
    setting = (os.environ if env is None else env).get(_ENV, "auto").strip().lower()
    if setting not in ("0", "1", "auto", ""):
        raise ValueError(f"{_ENV} must be 0, 1 or auto, got {setting!r}")
    if setting == "0":
        return False
    return setting == "1" or shared_memory_usable()


def build_level_backends(
    backend: Backend, topo: Topology, shared_memory: bool = False
) -> tuple[Backend, Backend]:
    """(local, cross) backends carved out of the global one (collective, every rank).

    With ``shared_memory``, the local level of a TorchBackend is a SharedMemoryBackend whose
    barriers (and small messages) run on the node's process group. The ranks of each node
    must agree on ``shared_memory`` (``ValueError`` on every rank otherwise: half a node in
    shared memory and half over gloo would wait for each other without end).

    Both levels end a collective within the same time as ``backend``: their process groups get
    its watchdog timeout, and they are watched like it (:func:`commopt.faults.watch_like`).
    """
    if isinstance(backend, TorchBackend):
        _agree_on_shared_memory(backend, topo, shared_memory)
        timeout = group_timeout(backend)

        # dist.new_group must be called by every rank of the default group, for every group, in
        # the same order: all nodes first, then all cross sets.
        def global_rank(r: int) -> int:
            return r if backend.group is None else dist.get_global_rank(backend.group, r)

        local_group = cross_group = None
        for i, ranks in enumerate(topo.nodes):
            group = dist.new_group(
                [global_rank(r) for r in ranks], backend=backend.engine, timeout=timeout
            )
            if i == topo.node:
                local_group = group
        for j in range(topo.local_size):
            ranks = [node[j] for node in topo.nodes]
            group = dist.new_group(
                [global_rank(r) for r in ranks], backend=backend.engine, timeout=timeout
            )
            if j == topo.local_rank:
                cross_group = group
        # A shared-memory level blocks only in its helper's collectives: watching the helper
        # guards it (and its reduce_scatter_mean_, which no wrapper knows).
        local: Backend = watch_like(backend, TorchBackend(local_group))
        if shared_memory:
            local = SharedMemoryBackend(local)
        return local, watch_like(backend, TorchBackend(cross_group))
    if isinstance(backend, MpiBackend):
        local_comm = backend.comm.Split(topo.node, topo.local_rank)
        cross_comm = backend.comm.Split(topo.local_rank, topo.node)
        return (
            watch_like(backend, MpiBackend(local_comm, cuda_aware=backend.cuda_aware)),
            watch_like(backend, MpiBackend(cross_comm, cuda_aware=backend.cuda_aware)),
        )
    raise TypeError(
        f"HierarchicalExchange cannot split a {type(backend).__name__} into node and cross-node "
        "groups by itself: pass local_backend= and cross_backend= (e.g. MpiBackend on a "
        "COMM_TYPE_SHARED communicator inside, TorchBackend on a process group across)"
    )


def _agree_on_shared_memory(backend: Backend, topo: Topology, shared_memory: bool) -> None:
    """Raise ``ValueError`` on every rank when the ranks of some node disagree on it."""
    flags = torch.empty(backend.world_size, dtype=torch.int64)
    backend.all_gather(flags, torch.tensor([int(shared_memory)], dtype=torch.int64))
    split = [ranks for ranks in topo.nodes if len({int(flags[r]) for r in ranks}) > 1]
    if split:
        detail = "; ".join(
            f"node of ranks {list(ranks)}: "
            + ", ".join(f"rank {r} {bool(flags[r])}" for r in ranks)
            for ranks in split
        )
        raise ValueError(
            "the ranks of a node disagree on using shared memory for the node's level "
            f"(shared_memory, or {_ENV} in their environment): {detail}. Set the same on every "
            "rank of a node"
        )


def check_level_backends(backend: Backend, topo: Topology, local: Backend, cross: Backend) -> None:
    """Every rank checks that both level backends hold the ranks the topology says.

    First (rank, size) on each level, all-gathered over the global backend so that a level
    collective is never entered by only some of its ranks; then, when those fit, each level
    all-gathers its members' global ranks. Any mismatch is raised on every rank.
    """
    be = backend
    mine = torch.tensor(
        [local.rank, local.world_size, cross.rank, cross.world_size], dtype=torch.int64
    )
    everyone = torch.empty(4 * be.world_size, dtype=torch.int64)
    be.all_gather(everyone, mine)
    claims = everyone.view(-1, 4).tolist()
    expected = {}
    for i, ranks in enumerate(topo.nodes):
        for j, r in enumerate(ranks):
            expected[r] = [j, topo.local_size, i, topo.num_nodes]
    bad = [r for r in range(be.world_size) if claims[r] != expected[r]]
    problems = []
    if not bad:
        for what, level, expect in (
            ("local_backend", local, topo.local_ranks),
            ("cross_backend", cross, topo.cross_ranks),
        ):
            members = torch.empty(len(expect), dtype=torch.int64)
            level.all_gather(members, torch.tensor([be.rank], dtype=torch.int64))
            if members.tolist() != list(expect):
                problems.append(
                    f"{what} holds global ranks {members.tolist()}; expected {list(expect)}"
                )
        flags = torch.zeros(be.world_size, dtype=torch.int64)
        flags[be.rank] = 1 if problems else 0
        be.all_reduce(flags)
        bad = [r for r in range(be.world_size) if flags[r]]
    elif claims[be.rank] != expected[be.rank]:
        lr, ls, cr, cs = claims[be.rank]
        el, els, ec, ecs = expected[be.rank]
        problems.append(
            f"local_backend is rank {lr} of {ls}, cross_backend rank {cr} of {cs}; expected "
            f"{el} of {els} (global ranks {list(topo.local_ranks)}) and {ec} of {ecs} "
            f"(global ranks {list(topo.cross_ranks)})"
        )
    if bad:
        detail = f"; here (rank {be.rank}): {'; '.join(problems)}" if problems else ""
        raise ValueError(f"level backends do not match the topology on rank(s) {bad}{detail}")
