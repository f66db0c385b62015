"""A rank that dies or hangs makes the others stop with an error, not hang (gloo).

Two forked ranks start through ``commopt.init(timeout=...)`` like a torchrun job; rank 1 kills
itself (SIGKILL) or stops calling collectives at step 4 of a 1-bit Adam run, and rank 0 must
exit non-zero, with an error naming the collective, within the timeout. The MPI counterpart is
``test_faults_mpi_launch.py``.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import commopt
from commopt.faults import EXIT_CODE, CollectiveError, watch
from tests.multirank.harness import free_port, run_fault_rank

TIMEOUT_S = 4.0


def _train_until_fault(rank: int, mode: str, out: str = "") -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = commopt.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    for step in range(1, 60):
        if rank == 1 and step == 4:
            if out:  # when the fault happened, so the test measures from there
                with open(os.path.join(out, "fault_time"), "w") as f:
                    f.write(repr(time.time()))
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(120)  # "hang": alive, but no longer calling collectives
        x = torch.randn(8, 16)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _gloo_rank(rank: int, port: int, mode: str, out: str) -> None:
    train = functools.partial(_train_until_fault, rank, mode, out)
    run_fault_rank(rank, 2, port, out, {}, train, TIMEOUT_S)


@pytest.mark.parametrize("mode", ["kill", "hang"])
def test_gloo_survivor_stops_with_an_error(tmp_path, mode):
    ctx = mp.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, mode, str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        procs[0].join(timeout=120)
        assert procs[0].exitcode is not None, "rank 0 still hangs after 120 s"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    assert procs[0].exitcode != 0
    message = (tmp_path / "rank0.txt").read_text()
    assert message.startswith("CollectiveError:"), message
    # Named: the operation, its number on this rank, this rank.
    assert any(f"{op} #" in message for op in ("all_reduce", "all_gather", "all_to_all"))
    assert "on rank 0 of 2 (torch backend)" in message
    # From the fault to rank 0's exit: within the timeout (plus slack for a loaded machine).
    waited = float((tmp_path / "rank0_end").read_text()) - float(
        (tmp_path / "fault_time").read_text()
    )
    if mode == "hang":
        assert "Timed out" in message or "timed out" in message, message
        assert TIMEOUT_S - 1 < waited < TIMEOUT_S + 10, waited
    else:
        assert waited < TIMEOUT_S + 10, waited


def test_watch_keeps_the_type_and_checks_the_timeout():
    be = commopt.SingleProcessBackend()
    watched = watch(be, 3.0)
    assert watched is be and isinstance(be, commopt.SingleProcessBackend)
    assert be.watchdog_timeout == 3.0
    t = torch.ones(3)
    assert be.all_reduce(t) is t  # world of one: passes straight through
    watch(be, 7.0)
    assert be.watchdog_timeout == 7.0
    with pytest.raises(ValueError, match=r"Invalid timeout: 0 \(must be > 0 seconds\)"):
        watch(commopt.SingleProcessBackend(), 0)


class _Stuck:
    """A two-rank backend whose all_reduce never returns and whose all_gather fails."""

    name = "mpi"
    rank = 0
    world_size = 2

    def __init__(self) -> None:
        self.stats = commopt.comm.CommStats()
        self.aborted: list[int] = []
        self.comm = self

    def Abort(self, code: int) -> None:
        self.aborted.append(code)  # a real MPI_Abort does not return; the watchdog then exits

    def all_reduce(self, t, op="sum"):
        time.sleep(30)
        return t

    def all_gather(self, out, t):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")


def test_failure_is_translated_and_argument_errors_are_not():
    be = watch(_Stuck(), 5.0)
    with pytest.raises(CollectiveError, match=r"all_gather #1 \(12 bytes\) on rank 0 of 2 \(mpi "):
        be.all_gather(torch.empty(6), torch.ones(3))
    try:
        be.all_gather(torch.empty(6), torch.ones(3))
    except CollectiveError as err:
        assert (err.op, err.seq, err.rank) == ("all_gather", 2, 0)
        assert "Connection closed by peer" in str(err)
    be.close_watchdog()


def _stuck_in_child(out: str) -> None:
    import logging

    logging.basicConfig(filename=os.path.join(out, "log.txt"), level=logging.INFO, force=True)
    be = watch(_Stuck(), 1.0)
    be.all_reduce(torch.ones(4))


def test_hung_collective_aborts_the_process(tmp_path):
    # The watchdog thread ends the process itself: run it in a child and read its log.
    ctx = mp.get_context("fork")
    p = ctx.Process(target=_stuck_in_child, args=(str(tmp_path),))
    start = time.monotonic()
    p.start()
    p.join(25)
    elapsed = time.monotonic() - start
    if p.is_alive():
        p.kill()
        pytest.fail("the watchdog did not end a collective hung past its timeout")
    assert p.exitcode == EXIT_CODE
    assert elapsed < 20
    log = (tmp_path / "log.txt").read_text()
    assert "all_reduce #1 (16 bytes) on rank 0 of 2 (mpi backend) has not completed" in log
    assert "MPI cannot tell which rank is missing" in log


def test_a_caught_failure_in_a_singleton_mpi_world_exits_zero(tmp_path):
    """The exit-time MPI_Abort is for ranks others may wait for: a process whose MPI world is
    just itself (mpi4py imported outside a launcher, e.g. a test run) exits normally even
    after a collective failed and was caught (it used to exit 70 at interpreter shutdown)."""
    pytest.importorskip("mpi4py")
    script = tmp_path / "caught.py"
    script.write_text(
        "import torch\n"
        "from mpi4py import MPI\n"
        "from commopt import faults\n"
        "from commopt.faults import CollectiveError, watch\n"
        "from tests.multirank.test_faults_gloo import _Stuck\n"
        "faults._abort_mpi_job_on_failure()  # as under a launcher (or an earlier test)\n"
        "be = watch(_Stuck(), 5.0)\n"
        "try:\n"
        "    be.all_gather(torch.empty(6), torch.ones(3))\n"
        "except CollectiveError:\n"
        "    pass\n"
        "be.close_watchdog()\n"
        "print('done', MPI.COMM_WORLD.Get_size())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "PMIX"))}
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "done 1" in proc.stdout
