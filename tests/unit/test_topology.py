"""discover_topology's pieces in one process: launcher tables, record checks, node numbering."""

from __future__ import annotations

import pytest

from commopt.comm import SingleProcessBackend
from commopt.exchange.topology import Topology, _build, _from_env, _hash_key, discover_topology

TORCHRUN, OPENMPI, SHARED, HOSTNAME = 0, 1, 2, 3


def torchrun_records(nodes: list[list[int]]) -> list[tuple[int, int, int, int]]:
    """Records as ranks launched by torchrun would send them, for ranks placed on ``nodes``."""
    world = sum(len(n) for n in nodes)
    records: list = [None] * world
    for i, ranks in enumerate(nodes):
        for j, r in enumerate(ranks):
            records[r] = (TORCHRUN, i, j, len(ranks))
    return records


def test_contiguous_blocks() -> None:
    topo = _build(torchrun_records([[0, 1], [2, 3]]), rank=3)
    assert topo == Topology(3, 1, 1, 2, 2, ((0, 1), (2, 3)), "torchrun")
    assert topo.local_ranks == (2, 3) and topo.cross_ranks == (1, 3)
    assert topo.uniform and topo.world_size == 4


def test_round_robin_placement() -> None:
    # mpirun --map-by node: rank r on node r % 2.
    topo = _build(torchrun_records([[0, 2, 4], [1, 3, 5]]), rank=4)
    assert topo.nodes == ((0, 2, 4), (1, 3, 5))
    assert (topo.node, topo.local_rank, topo.local_size, topo.num_nodes) == (0, 2, 3, 2)
    assert topo.cross_ranks == (4, 5)


def test_nodes_numbered_by_smallest_rank_not_by_key() -> None:
    records = [(OPENMPI, 999, 0, 2), (OPENMPI, 5, 0, 2), (OPENMPI, 999, 1, 2), (OPENMPI, 5, 1, 2)]
    assert _build(records, rank=1).nodes == ((0, 2), (1, 3))


def test_unequal_nodes_are_reported_not_refused() -> None:
    topo = _build(torchrun_records([[0, 1, 2], [3, 4]]), rank=4)
    assert not topo.uniform
    assert (topo.node, topo.local_rank, topo.local_size) == (1, 1, 2)
    assert topo.cross_ranks == (1, 4)


def test_local_size_must_match_the_node() -> None:
    records = torchrun_records([[0, 1], [2, 3]])
    records[3] = (TORCHRUN, 1, 1, 3)
    with pytest.raises(ValueError, match=r"report local sizes \[2, 3\]"):
        _build(records, rank=0)


def test_duplicate_local_ranks() -> None:
    records = torchrun_records([[0, 1], [2, 3]])
    records[1] = (TORCHRUN, 0, 0, 2)
    with pytest.raises(ValueError, match=r"local ranks \[0, 0\]; expected each of 0 … 1 once"):
        _build(records, rank=0)


def test_mixed_sources() -> None:
    records = torchrun_records([[0, 1], [2, 3]])
    records[2] = (HOSTNAME, 7, -1, -1)
    with pytest.raises(ValueError, match=r"different sources .*'hostname': \[2\]"):
        _build(records, rank=0)


def test_hostname_fallback_orders_by_global_rank() -> None:
    a, b = _hash_key("nodeA"), _hash_key("nodeB")
    records = [(HOSTNAME, k, -1, -1) for k in (b, a, b, a, b, a)]
    topo = _build(records, rank=3)
    assert topo.nodes == ((0, 2, 4), (1, 3, 5))
    assert (topo.node, topo.local_rank, topo.source) == (1, 1, "hostname")


def test_malformed_rank_reported() -> None:
    records = torchrun_records([[0, 1]])
    records[1] = (-1, 0, -1, -1)
    with pytest.raises(ValueError, match=r"malformed launcher variables on rank\(s\) \[1\]"):
        _build(records, rank=0)


def test_env_tables() -> None:
    env = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "3"}
    assert _from_env(env, "h") == ("torchrun", 3, 1, 4)
    # torchrun variables win over Open MPI's; without GROUP_RANK the node is the hostname.
    env = {"OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert _from_env(env, "h") == ("openmpi", _hash_key("h"), 0, 2)
    assert _from_env({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", **env}, "h")[0] == "torchrun"
    assert _from_env({"RANK": "0"}, "h") is None


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"LOCAL_RANK": "0"}, "LOCAL_RANK is set but LOCAL_WORLD_SIZE is not"),
        ({"LOCAL_RANK": "x", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK environment variable must"),
        ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, r"LOCAL_RANK=2 is outside \[0, "),
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "OMPI_COMM_WORLD_LOCAL_SIZE is set but"),
    ],
)
def test_env_errors(env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _from_env(env, "h")
    with pytest.raises(ValueError, match=f"rank 0: {match}"):
        discover_topology(SingleProcessBackend(), env)


def test_single_process() -> None:
    topo = discover_topology(SingleProcessBackend(), {}, hostname="me")
    assert topo == Topology(0, 0, 0, 1, 1, ((0,),), "hostname")
