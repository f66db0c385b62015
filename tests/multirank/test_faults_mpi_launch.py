"""A rank that dies or hangs under ``mpiexec`` ends the job with an error, not a hang.

Runs ``mpiexec -n 2`` in a subprocess of its own (a fault inside the suite's shared 4-rank
mpiexec job would take that whole job down), with ``commopt.init(backend, timeout=3)`` for both
backends an MPI launch can use:

- ``"mpi"``: MPI collectives cannot time out by themselves: when rank 1 stops calling them,
  rank 0's watchdog must abort the job; when rank 1 is killed, the launcher must end the job.
- ``"auto"`` (the default: gloo bootstrapped over MPI): gloo's timeout raises CollectiveError on
  rank 0, and rank 0 must then end the job; before issue #15.6 it waited in MPI_Finalize for the
  hung rank 1 and mpiexec never ended.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

_MPI_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch
    import commopt

    mode, timeout, backend = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    be = commopt.init(backend, timeout=timeout)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = commopt.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    for step in range(1, 60):
        if be.rank == 1 and step == 4:
            with open("fault_time", "w") as f:
                f.write(repr(time.time()))
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(300)
        opt.zero_grad()
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
    print("finished", flush=True)
    """
)


def _mpi_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OMPI_COMM_WORLD", "PMI_", "PMIX_"))
    }
    if os.getuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.update(
        PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
        OMPI_MCA_btl="self,tcp",
        OMPI_MCA_btl_tcp_if_include="lo",
        OMP_NUM_THREADS="1",
    )
    return env


def _run_failing_job(
    tmp_path, source: str, ranks: int, *args: str
) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run ``source`` under ``mpiexec -n ranks`` (timeout 3 s inside) and check that the job
    ended non-zero and unfinished within the timeout plus the launcher's tear-down, counted
    from the fault (the script writes ``fault_time``). Returns the process and its output."""
    script = tmp_path / "job.py"
    script.write_text(source)
    proc = subprocess.run(
        ["timeout", "150", "mpiexec", "-n", str(ranks), sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        env=_mpi_env(),
        cwd=str(tmp_path),
        timeout=180,
    )
    end = time.time()
    output = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124), f"rc={proc.returncode}\n{output[-3000:]}"
    assert "finished" not in proc.stdout
    # From the fault to the end of the whole job: the timeout plus the launcher's tear-down.
    waited = end - float((tmp_path / "fault_time").read_text())
    assert waited < 3 + 30, (waited, output[-3000:])
    return proc, output


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec on PATH")
@pytest.mark.parametrize("backend", ["mpi", "auto"])
@pytest.mark.parametrize("mode", ["kill", "hang"])
def test_mpi_survivor_stops(tmp_path, mode, backend):
    pytest.importorskip("mpi4py", reason="the MPI backend needs mpi4py")
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        pytest.skip("already inside an mpiexec job; this test launches its own")
    proc, output = _run_failing_job(tmp_path, _MPI_SCRIPT, 2, mode, "3", backend)
    if mode == "hang" and backend == "mpi":
        assert "commopt watchdog" in output and "has not completed" in output, output[-3000:]
        assert "on rank 0 of 2 (mpi backend)" in output
    if mode == "hang" and backend == "auto":
        assert "CollectiveError" in output and "(torch backend)" in output, output[-3000:]
        assert "calling MPI_Abort" in output, output[-3000:]
        assert proc.returncode != 1, "rank 0 must end the job (MPI_Abort), not only itself"


_MPI_LEVELS_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import commopt

    level, timeout = sys.argv[1], float(sys.argv[2])
    torch.set_num_threads(1)
    be = commopt.init("mpi", timeout=timeout)
    # two fake nodes of two ranks: the hierarchical exchange splits MPI_COMM_WORLD in levels
    local, node = be.rank % 2, be.rank // 2
    os.environ.update(LOCAL_RANK=str(local), LOCAL_WORLD_SIZE="2", GROUP_RANK=str(node))
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = commopt.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=2, topology="hierarchical")
    for step in range(1, 40):
        if be.rank == 1 and step == 4:
            def hang(*args, **kwargs):
                with open("fault_time", "w") as f:
                    f.write(repr(time.time()))
                time.sleep(300)
            stalled = getattr(opt.exchange, level + "_backend")
            for name in ("all_reduce", "all_gather", "all_to_all", "broadcast", "barrier"):
                setattr(stalled, name, hang)
        opt.zero_grad()
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
    print("finished", flush=True)
    """
)


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec on PATH")
@pytest.mark.parametrize("level", ["local", "cross"])
def test_mpi_rank_stalled_inside_a_hierarchical_level_ends_the_job(tmp_path, level):
    # Issue #41.1: the level communicators (comm.Split) were not watched; a rank stalled in the
    # node level left its node waiting there and the other node in the cross level, unbounded.
    pytest.importorskip("mpi4py", reason="the MPI backend needs mpi4py")
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        pytest.skip("already inside an mpiexec job; this test launches its own")
    _, output = _run_failing_job(tmp_path, _MPI_LEVELS_SCRIPT, 4, level, "3")
    assert "commopt watchdog" in output and "has not completed" in output, output[-3000:]
