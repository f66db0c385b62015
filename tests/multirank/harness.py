"""Start gloo ranks cheaply with fork, run a function on each, collect results or failures.

Each rank runs ``fn(backend, *args)`` with a fresh ``TorchBackend`` over gloo (FileStore in a
temporary directory) and sends back its return value. A rank that raises sends the exception
text; a rank that hangs is killed at ``timeout`` and the test fails saying so.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

import commopt
from experiments.harness.ranks import RankError, run_ranks

__all__ = ["RankError", "run_ranks"]  # (the launcher is the experiments' own)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """``pid``'s descendants, parents before children (Linux: /proc/<pid>/task/*/children)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the task exited meanwhile
            continue
        for child in children:
            found += [child, *_descendants(child)]
    return found


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


#: seconds an example may run under torchrun (a run takes 10-60 s; pytest-timeout is 300)
EXAMPLE_TIMEOUT = 200.0


def run_example_under_torchrun(
    example: Path,
    args: Sequence[str],
    out: Path,
    env: dict[str, str] | None = None,
    nproc: int = 2,
) -> dict[str, Any]:
    """Run ``example`` on ``nproc`` ranks under torchrun with ``--out out`` and return the
    ``result.json`` it wrote there; a non-zero exit fails with the end of its output. A run
    still going at :data:`EXAMPLE_TIMEOUT` fails with every rank's Python stacks: each of
    them gets SIGABRT, which faulthandler answers with a dump of all threads (torchrun starts
    its workers in sessions of their own, so they are found through /proc, not the group)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "PMIX_"))}
    full_env.update(OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    # each rank's stderr also in a file of its own: two ranks' stack dumps interleave on one pipe
    logs = out / "torchrun-logs"
    cmd += ["--log-dir", str(logs), "--redirects", "2", "--tee", "2"]
    cmd += ["--master_port", str(free_port()), str(example), *args, "--out", str(out)]
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, cwd=out
    ) as proc:
        try:
            output, _ = proc.communicate(timeout=EXAMPLE_TIMEOUT)
        except subprocess.TimeoutExpired:
            tree = _descendants(proc.pid)
            _signal_all(reversed(tree), signal.SIGABRT)  # the workers dump before torchrun acts
            try:
                output, _ = proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                _signal_all([proc.pid, *_descendants(proc.pid), *tree], signal.SIGKILL)
                output, _ = proc.communicate()
            ranks = "".join(
                f"\n--- {log.relative_to(logs)}:\n{log.read_text(errors='replace')[-6000:]}"
                for log in sorted(logs.glob("**/stderr.log"))
            )
            raise AssertionError(
                f"{example.name} still ran after {EXAMPLE_TIMEOUT:.0f} s; the stacks of its "
                f"processes at SIGABRT, rank by rank:{ranks}\n--- torchrun:\n{output[-4000:]}"
            ) from None
    assert proc.returncode == 0, output[-4000:]
    return json.loads((out / "result.json").read_text())


def run_fault_rank(
    rank: int,
    world: int,
    port: int,
    out: str,
    env: dict[str, str],
    train: Callable[[], None],
    timeout: float,
) -> None:
    """For the fault tests, which stop a rank on purpose: a forked rank as torchrun would start
    it (no MPI variables), ``commopt.init(timeout=timeout)``, then ``train()``; writes
    ``rank{r}.txt`` (its exception, or that it finished) and ``rank{r}_end`` (when), and exits
    (1 on an exception)."""
    try:
        torch.set_num_threads(1)
        for var in [v for v in os.environ if v.startswith(("OMPI_", "PMI_", "PMIX_"))]:
            del os.environ[var]
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            **env,
        )
        commopt.init("torch", device="cpu", timeout=timeout)
        train()
        message = "finished without error"
        code = 0
    except BaseException as err:
        message = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
        code = 1
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(message)
    with open(os.path.join(out, f"rank{rank}_end"), "w") as f:
        f.write(repr(time.time()))
    os._exit(code)
