"""Tests that run only inside one MPI job: ``mpiexec -n 4 python -m pytest tests/multirank/mpi``.

A plain ``pytest`` run (not started by an MPI launcher) collects nothing here: these tests are
run by the mpiexec job in ``scripts/test.sh`` instead. Every rank runs every test.

Rules that keep a failure from hanging the job:

- every collective of a test happens before its first assertion, and every rank reaches the
  same collectives (results are gathered with the ``allgather`` fixture and then checked on every
  rank, so all ranks pass or fail the same assertion together);
- a rank stuck in a collective anyway is killed by pytest-timeout's thread method (stacks are
  dumped, the process exits, and mpiexec ends the job), so the outer ``timeout`` is only the
  last resort.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from commopt.launch import launched_by_mpi

# Seconds one test may take on any rank before that rank is killed (and with it the job).
PER_TEST_TIMEOUT = 180

if not launched_by_mpi():
    collect_ignore_glob = ["*"]
else:
    import torch

    torch.set_num_threads(1)

    def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
        # The signal method cannot interrupt a rank blocked inside an MPI call; the thread
        # method can (it exits the process, which makes mpiexec end the job).
        for item in items:
            item.add_marker(pytest.mark.timeout(PER_TEST_TIMEOUT, method="thread"))


@pytest.fixture(scope="session")
def allgather() -> Callable[[Any], list[Any]]:
    """``allgather(obj)``: every rank's ``obj`` (pickled through MPI), in rank order."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.allgather


@pytest.fixture(scope="session")
def world() -> tuple[int, int]:
    """(rank, world size) of ``COMM_WORLD``; the tests need at least two ranks."""
    from mpi4py import MPI

    n = MPI.COMM_WORLD.Get_size()
    if n < 2:
        pytest.fail(f"the MPI tests need at least 2 ranks (mpiexec -n 4), got {n}")
    return MPI.COMM_WORLD.Get_rank(), n


@pytest.fixture
def mpi_backend(world: tuple[int, int]):
    """A fresh MpiBackend on COMM_WORLD (fresh counters) for each test."""
    from commopt.comm import MpiBackend

    return MpiBackend()


@pytest.fixture(scope="session")
def torch_backend(world: tuple[int, int]):
    """torch.distributed (gloo) started by ``commopt.init()`` under mpiexec.

    mpiexec sets no ``MASTER_ADDR``, so this is the MPI bootstrap of torch.distributed: rank 0
    opens a TCPStore and shares its address over MPI.
    """
    import os

    import torch.distributed as dist

    import commopt
    from commopt.comm import TorchBackend, set_default_backend

    if "MASTER_ADDR" in os.environ or "MASTER_PORT" in os.environ:
        pytest.fail("unset MASTER_ADDR/MASTER_PORT: this fixture tests the MPI bootstrap")
    backend = commopt.init()
    set_default_backend(None)  # tests pass their backends explicitly
    assert isinstance(backend, TorchBackend) and backend.engine == "gloo"
    assert (backend.rank, backend.world_size) == world
    yield backend
    dist.destroy_process_group()
