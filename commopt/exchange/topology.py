r"""Which ranks share a node: the layout a hierarchical exchange is built on.

:func:`discover_topology` answers, for every rank, "which node am I on, and who else is there?",
and checks that every rank got the same answer. Sources, first match wins:

1. the launcher's variables (a small table below): torchrun's ``LOCAL_RANK`` /
   ``LOCAL_WORLD_SIZE`` / ``GROUP_RANK`` (the node index), Open MPI's
   ``OMPI_COMM_WORLD_LOCAL_RANK`` / ``OMPI_COMM_WORLD_LOCAL_SIZE`` (no node index there: the node
   is told apart by its hostname);
2. MPI's ``COMM_TYPE_SHARED`` split, when the backend is an :class:`~commopt.comm.MpiBackend`
   (the ranks that can share memory are a node);
3. an all-gather of a hash of ``socket.gethostname()``.

Whatever the source, every rank then all-gathers one small record (source, node key, local rank,
local size) through the backend and builds the same :class:`Topology` from it, or every rank
raises the same ``ValueError``. Nodes are numbered by their smallest global rank; inside a node,
ranks are ordered by local rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
from collections.abc import Mapping

import torch

from commopt.comm import Backend, MpiBackend, resolve_backend
from commopt.comm.env import int_env

__all__ = ["Topology", "discover_topology"]

# (source, local-rank variable, local-size variable, node-index variable or None). The table
# is kept here on purpose (not shared with commopt.launch): a node index is what this module
# needs, and Open MPI has none, so its node is told apart by hostname.
_ENV_SOURCES = (
    ("torchrun", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"),
    ("openmpi", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", None),
)
# Codes for the sources in the all-gathered record (every rank must have used the same one).
_SOURCES = ("torchrun", "openmpi", "mpi-shared", "hostname")


@dataclasses.dataclass(frozen=True)
class Topology:
    """This rank's place in a job of ``world_size`` ranks spread over ``num_nodes`` nodes.

    ``nodes[i]`` lists the global ranks on node i in local-rank order, so
    ``nodes[node][local_rank] == rank``. Nodes are numbered by their smallest global rank.
    """

    rank: int
    node: int
    local_rank: int
    local_size: int
    num_nodes: int
    nodes: tuple[tuple[int, ...], ...]
    source: str  # "torchrun", "openmpi", "mpi-shared" or "hostname"

    @property
    def world_size(self) -> int:
        """All ranks, over every node."""
        return sum(len(ranks) for ranks in self.nodes)

    @property
    def uniform(self) -> bool:
        """Every node has the same number of ranks (what a hierarchical exchange needs)."""
        return len({len(ranks) for ranks in self.nodes}) == 1

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The global ranks on this rank's node, in local-rank order."""
        return self.nodes[self.node]

    @property
    def cross_ranks(self) -> tuple[int, ...]:
        """The global ranks with this rank's local rank, one per node, in node order."""
        return tuple(ranks[self.local_rank] for ranks in self.nodes if self.local_rank < len(ranks))


def _hash_key(name: str) -> int:
    """A 62-bit key for a hostname: fits int64 on every backend, collisions are negligible."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big") >> 2


def _from_env(env: Mapping[str, str], hostname: str) -> tuple[str, int, int, int] | None:
    """(source, node key, local rank, local size) from launcher variables, or None."""
    for source, rank_var, size_var, node_var in _ENV_SOURCES:
        if rank_var not in env and size_var not in env:
            continue
        missing = [v for v in (rank_var, size_var) if v not in env]
        if missing:
            raise ValueError(
                f"{rank_var if rank_var in env else size_var} is set but {missing[0]} is not: "
                "the launcher sets both; set both or neither"
            )
        local_rank, local_size = int_env(env, rank_var), int_env(env, size_var)
        if local_size < 1 or not 0 <= local_rank < local_size:
            raise ValueError(
                f"{rank_var}={local_rank} is outside [0, {size_var}={local_size}): fix or unset "
                "the launcher variables"
            )
        if node_var is not None and node_var in env:
            key = int_env(env, node_var)
        else:
            key = _hash_key(hostname)
        return source, key, local_rank, local_size
    return None


def _from_mpi_shared(backend: MpiBackend) -> tuple[str, int, int, int]:
    """The ranks that MPI says can share memory with this one: key = their smallest rank."""
    from mpi4py import MPI as mpi  # (imported by the MpiBackend already)

    shared = backend.comm.Split_type(mpi.COMM_TYPE_SHARED, key=backend.rank)
    try:
        key = shared.allreduce(backend.rank, op=mpi.MIN)
        return "mpi-shared", key, shared.Get_rank(), shared.Get_size()
    finally:
        shared.Free()


def discover_topology(
    backend: Backend | None = None,
    env: Mapping[str, str] | None = None,
    *,
    hostname: str | None = None,
) -> Topology:
    r"""Find which ranks of ``backend`` share a node, agreed on by every rank (collective).

    Sources in order (the first that applies on this rank is used, and every rank must use the
    same one): launcher variables in ``env`` (default ``os.environ``; torchrun's
    ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/``GROUP_RANK``, Open MPI's
    ``OMPI_COMM_WORLD_LOCAL_RANK``/``OMPI_COMM_WORLD_LOCAL_SIZE``); an MPI ``COMM_TYPE_SHARED``
    split when ``backend`` is an :class:`~commopt.comm.MpiBackend`; a hash of the hostname. Then
    one all-gather of (source, node key, local rank, local size) lets every rank check that the
    records fit together and build the same answer.

    Unequal node sizes (say 3 ranks on one node, 2 on another) are reported, not refused: the
    result has ``uniform == False``. They describe a valid job, and a correct (flat) compressed
    allreduce exists for it; only the hierarchical exchange cannot be built, because its cross-
    node groups pair local rank j of every node. So :class:`~commopt.exchange.hierarchical.
    HierarchicalExchange` raises a ``ValueError`` naming the node sizes, and
    ``build_exchange(..., "auto")`` falls back to the flat exchange with one warning — training
    still runs, at flat speed, and the user is told why. Contradictory records (a node whose
    ranks disagree on its size, duplicate local ranks, ranks using different sources) are
    always an error: they mean the launcher variables do not describe this job.

    Args:
        backend: the global backend (all ranks); ``None`` resolves as usual.
        env: launcher variables to read instead of ``os.environ`` (tests fake nodes with it;
            pass ``{}`` to skip the launcher source).
        hostname: used instead of ``socket.gethostname()`` where a hostname is needed.

    Returns:
        This rank's :class:`Topology`, consistent with every other rank's.

    Raises:
        ValueError: malformed launcher variables on this rank, or records that do not fit
            together across ranks (raised on every rank alike, naming the ranks).
    """
    be = resolve_backend(backend)
    env = os.environ if env is None else env
    host = socket.gethostname() if hostname is None else hostname
    # A malformed variable on one rank must not leave the others waiting in the all-gather:
    # it is reported through the record (source -1) and raised everywhere.
    local_error: str | None = None
    try:
        found = _from_env(env, host)
    except ValueError as err:
        found, local_error = None, str(err)
    if found is None and local_error is None:
        if isinstance(be, MpiBackend) and be.world_size > 1:
            found = _from_mpi_shared(be)
        else:
            found = ("hostname", _hash_key(host), -1, -1)  # local rank/size derived below
    if local_error is not None:
        record = [-1, 0, -1, -1]
    else:
        source, key, local_rank, local_size = found
        record = [_SOURCES.index(source), key, local_rank, local_size]
    mine = torch.tensor(record, dtype=torch.int64)
    everyone = torch.empty(4 * be.world_size, dtype=torch.int64)
    be.all_gather(everyone, mine)
    records = [tuple(int(v) for v in row) for row in everyone.view(-1, 4).tolist()]
    if local_error is not None:
        raise ValueError(f"rank {be.rank}: {local_error}")
    return _build(records, be.rank)


def _build(records: list[tuple[int, int, int, int]], rank: int) -> Topology:
    """The topology all ranks agree on, from every rank's (source, key, local rank, size)."""
    bad = [r for r, rec in enumerate(records) if rec[0] < 0]
    if bad:
        raise ValueError(f"malformed launcher variables on rank(s) {bad} (see that rank's error)")
    sources = {rec[0] for rec in records}
    if len(sources) != 1:
        by_source = {
            _SOURCES[s]: [r for r, rec in enumerate(records) if rec[0] == s] for s in sources
        }
        raise ValueError(
            f"ranks found their node from different sources {by_source}: launch every rank the "
            "same way (the launcher variables must be set on all ranks or on none)"
        )
    source = _SOURCES[sources.pop()]
    members: dict[int, list[int]] = {}
    for r, (_, key, _, _) in enumerate(records):
        members.setdefault(key, []).append(r)
    nodes = []
    for key, ranks in sorted(members.items(), key=lambda kv: kv[1][0]):
        if source == "hostname":
            nodes.append(tuple(ranks))  # local rank = order of global rank on the host
            continue
        sizes = {records[r][3] for r in ranks}
        if sizes != {len(ranks)}:
            raise ValueError(
                f"node {key} ({source}) has ranks {ranks} but they report local sizes "
                f"{[records[r][3] for r in ranks]}: the local size must equal the number of "
                "ranks that share the node"
            )
        local = sorted(ranks, key=lambda r: records[r][2])
        if [records[r][2] for r in local] != list(range(len(ranks))):
            raise ValueError(
                f"node {key} ({source}) has ranks {ranks} with local ranks "
                f"{[records[r][2] for r in ranks]}; expected each of 0 … {len(ranks) - 1} once"
            )
        nodes.append(tuple(local))
    node = next(i for i, ranks in enumerate(nodes) if rank in ranks)
    return Topology(
        rank=rank,
        node=node,
        local_rank=nodes[node].index(rank),
        local_size=len(nodes[node]),
        num_nodes=len(nodes),
        nodes=tuple(nodes),
        source=source,
    )
