"""discover_topology on 4 forked gloo ranks, faking nodes through the launcher env or hostnames."""

from __future__ import annotations

import pytest

from commopt.exchange.topology import discover_topology
from tests.multirank.harness import RankError, run_ranks

TIMEOUT = 60.0


def torchrun_env(rank: int, local_size: int) -> dict[str, str]:
    return {
        "LOCAL_RANK": str(rank % local_size),
        "LOCAL_WORLD_SIZE": str(local_size),
        "GROUP_RANK": str(rank // local_size),
    }


def _torchrun(backend, local_size):
    return discover_topology(backend, torchrun_env(backend.rank, local_size))


def _hostnames(backend, names):
    return discover_topology(backend, {}, hostname=names[backend.rank])


def _openmpi(backend, names):
    # Round-robin placement as mpirun --map-by node makes it: local rank = rank // 2.
    env = {
        "OMPI_COMM_WORLD_LOCAL_RANK": str(backend.rank // 2),
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    return discover_topology(backend, env, hostname=names[backend.rank])


def _one_bad(backend, env_of_rank):
    return discover_topology(backend, env_of_rank[backend.rank])


@pytest.mark.parametrize("local_size", [1, 2, 4])
def test_torchrun_env(local_size: int) -> None:
    topos = run_ranks(_torchrun, 4, local_size, timeout=TIMEOUT)
    expect = tuple(tuple(range(i, i + local_size)) for i in range(0, 4, local_size))
    for rank, t in enumerate(topos):
        assert (t.rank, t.nodes, t.source) == (rank, expect, "torchrun")
        assert (t.node, t.local_rank) == divmod(rank, local_size)
        assert t.num_nodes == 4 // local_size and t.local_size == local_size
        assert t.nodes[t.node][t.local_rank] == rank


def test_hostname_fallback() -> None:
    topos = run_ranks(_hostnames, 4, ["b", "a", "b", "a"], timeout=TIMEOUT)
    assert {t.nodes for t in topos} == {((0, 2), (1, 3))}
    assert [(t.node, t.local_rank, t.source) for t in topos] == [
        (0, 0, "hostname"), (1, 0, "hostname"), (0, 1, "hostname"), (1, 1, "hostname"),
    ]  # fmt: skip
    assert [t.cross_ranks for t in topos] == [(0, 1), (0, 1), (2, 3), (2, 3)]


def test_openmpi_env_with_hostnames() -> None:
    topos = run_ranks(_openmpi, 4, ["x", "y", "x", "y"], timeout=TIMEOUT)
    assert [(t.node, t.local_rank, t.source) for t in topos] == [
        (0, 0, "openmpi"), (1, 0, "openmpi"), (0, 1, "openmpi"), (1, 1, "openmpi"),
    ]  # fmt: skip


def test_unequal_nodes() -> None:
    topos = run_ranks(_hostnames, 4, ["a", "a", "a", "b"], timeout=TIMEOUT)
    assert all(t.nodes == ((0, 1, 2), (3,)) and not t.uniform for t in topos)


def test_contradicting_env_raises_on_every_rank() -> None:
    envs = [torchrun_env(r, 2) for r in range(4)]
    envs[3] = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "1"}
    with pytest.raises(RankError) as info:
        run_ranks(_one_bad, 4, envs, timeout=TIMEOUT)
    assert all(m and "report local sizes [2, 3]" in m for m in info.value.messages)


def test_malformed_env_on_one_rank_raises_on_every_rank() -> None:
    envs = [torchrun_env(r, 2) for r in range(4)]
    envs[1] = {"LOCAL_RANK": "one", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}
    with pytest.raises(RankError) as info:
        run_ranks(_one_bad, 4, envs, timeout=TIMEOUT)
    messages = info.value.messages
    assert messages[1] and "LOCAL_RANK environment variable must be an integer" in messages[1]
    assert all(m and "malformed launcher variables on rank(s) [1]" in m for m in messages[::2])
    assert messages[3] and "rank(s) [1]" in messages[3]


def test_env_set_on_some_ranks_only() -> None:
    envs = [torchrun_env(r, 2) for r in range(4)]
    envs[2] = {}
    with pytest.raises(RankError) as info:
        run_ranks(_one_bad, 4, envs, timeout=TIMEOUT)
    assert all(m and "different sources" in m for m in info.value.messages)
