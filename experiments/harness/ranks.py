"""The one rank launcher of the experiments (and of the tests, which import it from here).

:func:`run_ranks` forks ``world_size`` gloo ranks on this machine, cheaply (0.1 s, against 7 s
for torchrun), runs ``fn(backend, *args)`` on each with a fresh ``TorchBackend`` (a FileStore in
a temporary directory, one torch thread each) and returns every rank's result; a rank that raises
sends its exception text, a rank that hangs is killed at ``timeout``. :func:`launch` is the
experiments' entry on top of it: under a launcher (torchrun, mpirun, ``netlab run``) this process
is one rank; otherwise it forks the ranks with :func:`run_ranks`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import commopt

__all__ = ["RankError", "launch", "run_ranks"]


class RankError(RuntimeError):
    """A rank raised; ``messages[r]`` is rank r's exception text (None where it succeeded)."""

    def __init__(self, messages: list[str | None]) -> None:
        self.messages = messages
        shown = "\n".join(f"--- rank {r} ---\n{m}" for r, m in enumerate(messages) if m)
        super().__init__(shown)


def _worker(
    rank: int, n: int, path: str, engine: str, fn: Callable, args: tuple, queue: Any
) -> None:
    try:
        torch.set_num_threads(1)
        from commopt.comm import TorchBackend, set_default_backend

        # A rank that leaves a group's creation and returns or raises at once (an argument
        # check, a group no collective ever runs on) would otherwise exit and close its sockets
        # while a slower rank is still inside gloo's connectFullMesh, which then fails with
        # "Connection closed by peer" (seen in CI for the world group and for a dist.new_group).
        # torch's own switch ends every group's creation, init_process_group's included, with a
        # store-based barrier of all ranks: leaving it means every rank has finished connecting.
        os.environ["TORCH_DIST_INIT_BARRIER"] = "1"
        dist.init_process_group(engine, init_method=f"file://{path}", rank=rank, world_size=n)
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
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    start: str = "fork",
    engine: str = "gloo",
) -> list[Any]:
    """Run ``fn(backend, *args)`` on ``world_size`` forked gloo ranks; return results by rank.

    ``start="spawn"`` starts fresh interpreters instead (CUDA cannot be used in a forked child
    of a process that touched it; ``fn`` must then be importable by name). ``engine`` is
    ``init_process_group``'s backend: ``"cuda:gloo"`` gives a group without a CPU backend, as
    NCCL's, on ranks that share one GPU.

    Raises:
        RankError: some rank raised (all messages included).
        TimeoutError: some rank did not finish within ``timeout`` seconds.
    """
    ctx = mp.get_context(start)
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker, args=(r, world_size, path, engine, fn, args, queue), daemon=True
            )
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


def _rank_zero_result(backend: Any, fn: Callable[..., Any], *args: Any) -> Any:
    result = fn(*args)
    return result if backend.rank == 0 else None  # (only rank 0's comes back)


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 3600.0) -> Any:
    """Run ``fn(*args)`` on every rank; return rank 0's result (``None`` on the other ranks).

    Under a launcher (``RANK`` or an MPI rank variable in the environment: torchrun, mpirun,
    ``netlab run``) this process is one rank: ``commopt.init()`` starts it and ``world_size``
    is ignored. Otherwise ``world_size`` gloo ranks are forked on this machine
    (:func:`run_ranks`) and this process waits for them.

    Raises:
        RankError: a rank failed (its traceback is in the message).
        TimeoutError: a rank did not finish within ``timeout`` seconds.
    """
    if any(v in os.environ for v in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")):
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        backend = commopt.init(timeout=timeout)
        try:
            return _rank_zero_result(backend, fn, *args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    return run_ranks(_rank_zero_result, world_size, fn, *args, timeout=timeout)[0]
