"""Launch discovery and start-up: who am I, how many are we, and one call to get going.

``init()`` reads the environment left by the launcher — torchrun's ``RANK``/``WORLD_SIZE``/
``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``, Open MPI's ``OMPI_COMM_WORLD_*`` or MPICH/Hydra's
``PMI_*`` — starts torch.distributed (NCCL on GPU, gloo on CPU) or an MPI backend, and makes it
what ``backend=None`` means. Under ``mpirun`` alone there is no ``MASTER_ADDR``: rank 0 opens a
``TCPStore`` on a free port and tells the others where it is through MPI.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import math
import socket
import time
from collections.abc import Iterable
from typing import Literal

import torch
import torch.distributed as dist

from commopt.comm import (
    Backend,
    MpiBackend,
    SingleProcessBackend,
    TorchBackend,
    resolve_backend,
    set_default_backend,
)
from commopt.comm.env import MPI_LAUNCHERS, LaunchInfo, discover_launch, launched_by_mpi
from commopt.faults import close_watchdogs, watch
from commopt.optim._agreement import check_same_model

__all__ = [
    "LaunchInfo",
    "broadcast_parameters",
    "destroy_process_group",
    "discover_launch",
    "init",
    "launched_by_mpi",
    "shutdown",
]

logger = logging.getLogger(__name__)

_owns_process_group = False  # init() created torch.distributed's default group


def _master_address(hostnames: list[str]) -> str:
    """An address of this host (rank 0's) that the hosts in ``hostnames`` can connect to.

    One host: loopback. Several: what this host's name resolves to, unless that is a loopback
    address (as ``/etc/hosts`` often makes it); then the local address of the route towards
    another rank's host (a UDP ``connect`` sends nothing, it only picks the interface).
    """
    me = socket.gethostname()
    if len(set(hostnames)) == 1:
        return "127.0.0.1"
    addr = socket.gethostbyname(me)
    if not addr.startswith("127."):
        return addr
    peer = next(h for h in hostnames if h != me)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(peer), 9))
            return s.getsockname()[0]
    except OSError as err:
        raise RuntimeError(
            f"cannot find an address of {me!r} that {peer!r} can reach ({me!r} resolves to "
            f"{addr}): set MASTER_ADDR to one"
        ) from err


def _mpi_bootstrap_store(info: LaunchInfo, timeout: datetime.timedelta) -> dist.TCPStore:
    """A torch.distributed store whose address rank 0 shares with the others over MPI."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() != info.world_size:
        raise RuntimeError(
            f"MPI reports {comm.Get_size()} processes but the launcher variables say "
            f"{info.world_size}"
        )
    hostnames = comm.allgather(socket.gethostname())
    if info.rank == 0:
        try:
            addr = info.master_addr or _master_address(hostnames)
            # wait_for_workers=False: the others learn the port only from the bcast below, so
            # a master that waited for them here would never get there.
            store = dist.TCPStore(
                addr, 0, info.world_size, is_master=True, timeout=timeout, wait_for_workers=False
            )
        except Exception as err:
            # Tell the others before failing, or they would wait in the bcast forever.
            comm.bcast(f"{type(err).__name__}: {err}", root=0)
            raise
        addr_port = comm.bcast((addr, store.port), root=0)
    else:
        addr_port = comm.bcast(None, root=0)
        if isinstance(addr_port, str):
            raise RuntimeError(
                f"rank 0 could not open the torch.distributed store ({addr_port}); set "
                "MASTER_ADDR to an address of rank 0's host that the other hosts can reach"
            )
        addr, port = addr_port
        store = dist.TCPStore(addr, port, info.world_size, is_master=False, timeout=timeout)
    logger.info("rank %d: torch.distributed bootstrapped over MPI at %s:%d", info.rank, *addr_port)
    return store


def init(
    backend: Literal["auto", "torch", "mpi"] = "auto",
    *,
    device: str | torch.device | None = None,
    timeout: float = 600.0,
    cuda_aware: bool = False,
) -> Backend:
    """Start communication for this process and make it the default backend.

    Args:
        backend: ``"torch"`` (torch.distributed: NCCL for CUDA, gloo for CPU), ``"mpi"``
            (mpi4py on ``COMM_WORLD``) or ``"auto"``, which means ``"torch"``.
        device: the device training runs on; chooses NCCL vs gloo. Default: CUDA (GPU
            ``LOCAL_RANK``) when available, else CPU.
        timeout: seconds a collective may wait for the other ranks before failing. With
            more than one rank the backend is wrapped in :func:`commopt.faults.watch`:
            a failed collective raises ``CollectiveError`` naming the operation, and one that
            hangs past ``timeout`` ends the job (MPI: ``MPI_Abort``; torch: its own timeout
            raises first).
        cuda_aware: for ``"mpi"``, pass CUDA buffers straight to a CUDA-aware MPI.

    Returns:
        The backend now used wherever ``backend=None``.

    Raises:
        ValueError: inconsistent launcher environment, an unknown ``backend``, or a
            ``timeout`` that is not a finite number of seconds > 0.
    """
    global _owns_process_group
    if backend not in ("auto", "torch", "mpi"):
        raise ValueError(f"Invalid backend: {backend!r} (expected 'auto', 'torch' or 'mpi')")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"Invalid timeout: {timeout!r} (must be a number of seconds)")
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(
            f"Invalid timeout: {timeout} (must be a finite number of seconds > 0; it bounds how "
            "long a collective may wait for the other ranks, e.g. 600)"
        )
    info = discover_launch()
    if backend == "mpi":
        chosen: Backend = MpiBackend(cuda_aware=cuda_aware)
        if chosen.world_size != info.world_size:
            raise RuntimeError(
                f"init('mpi'): MPI COMM_WORLD has {chosen.world_size} process(es) but the "
                f"{info.launcher} launcher variables say {info.world_size}; start the job with "
                "mpirun/mpiexec for backend='mpi', or use backend='torch' under torchrun"
            )
        if chosen.world_size > 1:
            chosen = watch(chosen, timeout)
        set_default_backend(chosen)
        return chosen

    if device is None:
        device = f"cuda:{info.local_rank}" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)

    if dist.is_initialized():  # the user's own group: supported, used as it is
        logger.info("torch.distributed is already initialized; commopt uses its default group")
    elif info.world_size == 1:
        chosen = SingleProcessBackend()
        set_default_backend(chosen)
        return chosen
    else:
        engine = "nccl" if device.type == "cuda" else "gloo"
        td = datetime.timedelta(seconds=timeout)
        if info.launcher in MPI_LAUNCHERS and not (info.master_addr and info.master_port):
            store = _mpi_bootstrap_store(info, td)
            dist.init_process_group(
                engine, store=store, rank=info.rank, world_size=info.world_size, timeout=td
            )
            _owns_process_group = True
            _shutdown_at_exit()
        else:
            if info.master_addr is None or info.master_port is None:
                raise ValueError(
                    "MASTER_ADDR and MASTER_PORT must both be set to start torch.distributed "
                    f"(got MASTER_ADDR={info.master_addr!r}, MASTER_PORT={info.master_port!r})"
                )
            dist.init_process_group(
                engine,
                init_method=f"tcp://{info.master_addr}:{info.master_port}",
                rank=info.rank,
                world_size=info.world_size,
                timeout=td,
            )
            _owns_process_group = True
            _shutdown_at_exit()
    chosen = TorchBackend()
    if chosen.world_size > 1:
        chosen = watch(chosen, timeout)
    set_default_backend(chosen)
    return chosen


_shutdown_registered = False


def _shutdown_at_exit() -> None:
    """Register :func:`_destroy_at_exit` with ``atexit`` (once): the group init() made is
    destroyed before interpreter teardown even if the script never calls shutdown()."""
    global _shutdown_registered
    if not _shutdown_registered:
        atexit.register(_destroy_at_exit)
        _shutdown_registered = True


def _destroy_at_exit() -> None:
    global _owns_process_group
    close_watchdogs()
    if _owns_process_group and dist.is_available() and dist.is_initialized():
        # Not destroy_process_group()'s collective drain: a rank can reach exit alone (an
        # exception), and a barrier there would hang it. Only its non-collective half.
        if _uses_gloo(None):
            time.sleep(_GLOO_PAUSE)
        dist.destroy_process_group()
    _owns_process_group = False
    set_default_backend(None)


def shutdown() -> None:
    """End what :func:`init` started; call it on every rank when training is over.

    Stops (and joins) the watchdog threads and clears the default backend. Safe to call more
    than once, without :func:`init`, and before or after your own
    ``torch.distributed.destroy_process_group()``: the default group :func:`init` created is
    left alive for that call, and destroyed at interpreter exit if nobody destroyed it (one
    you created yourself is left to you). Collectives through commopt after it need a new
    :func:`init`.

    Why it matters: a process that reaches interpreter teardown with the process group alive
    can die there with SIGABRT ("terminate called without an active exception": gloo's threads
    destroyed while joinable; seen in 1 of 10 two-rank runs on this project's machine). So
    :func:`init` registers an ``atexit`` hook when it creates the group, and a script tears
    down in order whatever it calls: watchdog first, then the process group, then exit. (Until
    0.2, shutdown() destroyed the group itself, and the common ``dist.destroy_process_group()``
    after it then failed with "Process group cannot be None".)
    """
    close_watchdogs()
    set_default_backend(None)


_SETTLE_TIMEOUT = 60.0  # seconds one probe may stay in gloo's hands after it completed
# Seconds with the GIL free before a gloo group is destroyed, for a worker that completed the
# last collective but has not yet taken gloo's work lock to free it.
_GLOO_PAUSE = 0.05
# torch's own (private) count of a tensor's holders; on a torch without it,
# destroy_process_group() gets the barrier and the pause only.
_use_count = getattr(torch.Tensor, "_use_count", None)


def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
    """``torch.distributed.destroy_process_group(group)``, once gloo's worker threads have let go
    of every collective. Collective: call it on every rank, where the run would call torch's.

    Why: a DDP model holds its process group from C++. Freed after the group was destroyed
    (the usual order: the script's locals die when it returns), it destroys the group, and
    gloo's destructor joins its worker threads while holding the GIL. A worker can still be
    letting go of the run's last collective at that moment, and freeing a tensor that Python
    also saw takes the GIL (torch 2.13), so each waits for the other forever. CI saw it in
    the Hugging Face example: one rank stuck after writing its result, in
    ``~Reducer → ~ProcessGroupGloo → join`` against ``~AsyncBarrierWork → decref_pyobject``.

    So it first waits for every collective to complete (a barrier), then sleeps 50 ms with the
    GIL free, so that a worker that has completed one but not yet taken gloo's work lock to
    free it can take it, then runs a one-element all-reduce and waits (sleeping) until gloo
    has freed that too: its tensor's use count is back to 1. Queueing the all-reduce takes the
    same lock, so any freeing under way has finished by then. On NCCL alone, which has no such
    workers, this is torch's call.

    Raises:
        RuntimeError: torch.distributed is not initialized (as torch's call does).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "commopt.destroy_process_group: torch.distributed is not initialized (nothing to end)"
        )
    if _uses_gloo(group):
        dist.barrier(group=group)
        time.sleep(_GLOO_PAUSE)
        probe = torch.zeros(1)
        dist.all_reduce(probe, group=group)
        deadline = time.monotonic() + _SETTLE_TIMEOUT
        while _use_count is not None and _use_count(probe) > 1:  # gloo still holds the probe
            if time.monotonic() > deadline:
                logger.warning(
                    "commopt.destroy_process_group: gloo still held its last collective after "
                    "%.0f s; destroying the group anyway",
                    _SETTLE_TIMEOUT,
                )
                break
            time.sleep(0.001)
    dist.destroy_process_group(group)


def _uses_gloo(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` (None: the default group) runs gloo, alone or beside NCCL
    ("cpu:gloo,cuda:nccl")."""
    return "gloo" in str(dist.get_backend(group))


@torch.no_grad()
def broadcast_parameters(
    params: torch.nn.Module | Iterable[torch.Tensor], src: int = 0, backend: Backend | None = None
) -> None:
    """Overwrite every parameter and buffer with rank ``src``'s copy, so all replicas start equal.

    Accepts a module (its parameters and buffers, in ``state_dict`` order) or an iterable of
    tensors. Every rank must pass the same tensors in the same order.

    Raises:
        ValueError: on every rank alike, when the ranks hold different numbers of tensors or
            different shapes or dtypes, naming the first mismatch (checked before anything is
            overwritten, with two small all-reduces).
    """
    be = resolve_backend(backend)
    if isinstance(params, torch.nn.Module):
        named = list(params.state_dict(keep_vars=True).items())
        names = [k for k, _ in named]
        tensors = [t for _, t in named]
    else:
        tensors = list(params)
        names = [f"tensor {i}" for i in range(len(tensors))]
    if be.world_size == 1:
        return
    check_same_model(
        be,
        tensors,
        names.__getitem__,
        noun="tensor",
        index="index",
        prefix="broadcast_parameters: ",
        advice="Every rank must pass the same model (parameters and buffers), in the same order",
    )
    for t in tensors:
        t = t.data if isinstance(t, torch.nn.Parameter) else t
        if t.is_contiguous():
            be.broadcast(t, src)
        else:
            tmp = t.contiguous()
            be.broadcast(tmp, src)
            t.copy_(tmp)
