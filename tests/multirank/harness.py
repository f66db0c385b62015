"""Start gloo ranks cheaply with fork, run a function on each, collect results or failures.

Each rank runs ``fn(backend, *args)`` with a fresh ``TorchBackend`` over gloo (FileStore in a
temporary directory) and sends back its return value. A rank that raises sends the exception
text; a rank that hangs is killed at ``timeout`` and the test fails saying so.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import commopt

__all__ = ["RankError", "run_ranks"]


class RankError(RuntimeError):
    """A rank raised; ``messages[r]`` is rank r's exception text (None where it succeeded)."""

    def __init__(self, messages: list[str | None]) -> None:
        self.messages = messages
        shown = "\n".join(f"--- rank {r} ---\n{m}" for r, m in enumerate(messages) if m)
        super().__init__(shown)


def _worker(rank: int, n: int, path: str, fn: Callable, args: tuple, queue: Any) -> None:
    try:
        torch.set_num_threads(1)
        from commopt.comm import TorchBackend, set_default_backend

        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=n)
        backend = TorchBackend()
        set_default_backend(backend)
        result = fn(backend, *args)
        # Plain pickle: torch's multiprocessing reducers would share tensors through file
        # descriptors that die with this process.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException as err:  # report everything, including assertion failures
        queue.put((rank, False, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable, world_size: int, *args: Any, timeout: float = 60.0, start: str = "fork"
) -> list[Any]:
    """Run ``fn(backend, *args)`` on ``world_size`` forked gloo ranks; return results by rank.

    ``start="spawn"`` starts fresh interpreters instead (CUDA cannot be used in a forked child
    of a process that touched it; ``fn`` must then be importable by name).

    Raises:
        RankError: some rank raised (all messages included).
        TimeoutError: some rank did not finish within ``timeout`` seconds.
    """
    ctx = mp.get_context(start)
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, path, fn, args, queue), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, tuple[bool, Any]] = {}
        try:
            for _ in range(world_size):
                rank, ok, value = queue.get(timeout=timeout)
                results[rank] = (ok, value)
        except Exception:
            for p in procs:
                p.kill()
            missing = sorted(set(range(world_size)) - set(results))
            raise TimeoutError(
                f"ranks {missing} did not finish within {timeout} s; others: "
                f"{ {r: v[1] for r, v in results.items() if not v[0]} }"
            ) from None
        for p in procs:
            p.join(timeout)
    if not all(ok for ok, _ in results.values()):
        raise RankError([None if results[r][0] else results[r][1] for r in range(world_size)])
    return [pickle.loads(results[r][1]) for r in range(world_size)]


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
    example: Path, args: Sequence[str], out: Path, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``example`` on 2 ranks under torchrun with ``--out out`` and return the
    ``result.json`` it wrote there; a non-zero exit fails with the end of its output. A run
    still going at :data:`EXAMPLE_TIMEOUT` fails with every rank's Python stacks: each of
    them gets SIGABRT, which faulthandler answers with a dump of all threads (torchrun starts
    its workers in sessions of their own, so they are found through /proc, not the group)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "PMIX_"))}
    full_env.update(OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
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
