"""MPI through mpi4py as a commopt backend.

CPU tensors are handed to MPI as they are, without copies: mpi4py reads a tensor's address, shape
and dtype through DLPack, so MPI reads and writes the tensor's own storage. CUDA tensors are
staged through (pageable) host memory unless ``cuda_aware=True``, in which case the device
pointer goes straight to MPI — only correct with a CUDA-aware MPI build, which commopt cannot
verify for you. MPI knows nothing of CUDA streams, so before a device buffer is handed over the
current stream is synchronized (staging does the same through its blocking device-to-host copy).

MPI has no bfloat16 or float16 reduction, so reductions of those dtypes run in float32 and are
rounded back once (the byte counter still records the tensor's own 16-bit size, as for every
backend, although twice that crosses the wire); data movement (gather, all-to-all, broadcast)
is bitwise and works for every dtype (half types travel as 16-bit integers, ``bool`` as
bytes). ``bool`` reductions follow torch.distributed: ``"sum"`` and ``"max"`` are a logical OR,
``"min"`` a logical AND.

Non-blocking collectives (``all_reduce_async``, ``all_gather_async``, ``all_to_all_async``; see
:mod:`commopt.comm.asynchronous`) post ``Iallreduce``/``Iallgather``/``Ialltoall`` and return a
``torch.futures.Future``. A future must complete without anyone polling MPI for it (a DDP hook's
future is waited on by DDP's C++ code), and Open MPI advances a non-blocking collective only
inside MPI calls, so one daemon thread per backend waits on the requests in the order they were
posted (``Request.Wait``, which mpi4py runs without the GIL) and completes the futures. That needs
``MPI_THREAD_MULTIPLE`` (mpi4py asks for it by default); with a lower thread level, for staged
CUDA buffers and for half-precision reductions the ``*_async`` methods run the blocking
collective and return a completed future: the same result, without overlap.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from commopt.comm.base import CommStats, ReduceOp, check_equal_split
from commopt.comm.channels import current_channel
from commopt.comm.handoff import completed_future, device_future

__all__ = ["MpiBackend"]

_HALF = (torch.bfloat16, torch.float16)


def _import_mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as err:  # pragma: no cover - exercised only without mpi4py
        raise ImportError("MpiBackend needs mpi4py: pip install 'commopt[mpi]'") from err
    return MPI


def _stage_through_host(device: torch.device, cuda_aware: bool) -> bool:
    """Whether a tensor on ``device`` must be copied to host memory before MPI may touch it.

    CPU: never. CUDA: unless the MPI library is CUDA-aware. Anything else is refused.
    """
    if device.type == "cpu":
        return False
    if device.type == "cuda":
        return not cuda_aware
    raise ValueError(
        f"MpiBackend: tensors on {device} are not supported; MPI takes CPU tensors, or CUDA "
        "tensors (staged through host memory, or passed directly with cuda_aware=True)"
    )


def _wire(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t``'s storage with a dtype MPI can describe (a view: no bytes are copied).

    Half types travel as 16-bit integers and ``bool`` as ``uint8`` — bitwise, no arithmetic.
    """
    if t.dtype in _HALF:
        return t.view(torch.int16)
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t


class _Progress:
    """A daemon thread that waits on MPI requests in posting order and completes their futures.

    ``submit(request, finish)`` returns a future whose value is ``finish()``, called on the
    thread once the request is complete (or the MPI error, if ``Wait`` raised one).
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, Callable[[], Any], torch.futures.Future]] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(
        self, request: Any, finish: Callable[[], Any], device: torch.device
    ) -> torch.futures.Future:
        # CUDA-aware on a device: finish() runs on this thread's stream, set_result records
        # an event there and the consumer's wait() orders its stream after it (comm.handoff).
        fut: torch.futures.Future = device_future(device)
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="commopt-mpi-progress", daemon=True
                )
                self._thread.start()
            self._queue.put((request, finish, fut))
        return fut

    def _run(self) -> None:
        while True:
            request, finish, fut = self._queue.get()
            try:
                request.Wait()  # GIL released inside: other Python threads run meanwhile
                value = finish()
            except BaseException as err:  # handed to whoever waits on the future
                fut.set_exception(err)
            else:
                fut.set_result(value)


class MpiBackend:
    """Collectives through mpi4py on ``comm`` (default ``MPI.COMM_WORLD``).

    Args:
        comm: an mpi4py intracommunicator; every rank of it must take part in every call.
        cuda_aware: hand CUDA device pointers straight to MPI instead of staging through host
            memory. Only set this when your MPI library is built with CUDA support.
    """

    name = "mpi"

    def __init__(self, comm: Any = None, *, cuda_aware: bool = False) -> None:
        MPI = _import_mpi()
        self._mpi = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = self.comm.Get_rank()
        self.world_size = self.comm.Get_size()
        self.cuda_aware = cuda_aware
        self.stats = CommStats()
        self._channels: dict[str, Any] = {}
        self._reduce_ops = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
        # torch.distributed's convention for bool: sum/max = OR, min = AND (as 0/1 bytes).
        self._bool_ops = {"sum": MPI.MAX, "max": MPI.MAX, "min": MPI.MIN}
        # Non-blocking collectives need a second thread inside MPI (see the module docstring).
        self.nonblocking = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self._progress = _Progress()

    # -- buffers -------------------------------------------------------------------------------
    def _to_mpi(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor MPI reads: ``t`` itself (CPU, CUDA-aware) or a host copy of it (CUDA).

        The host copy is blocking, so it waits for the device work that produces ``t``; a
        device buffer handed over directly must be made ready with :meth:`_ready`.
        """
        if _stage_through_host(t.device, self.cuda_aware):
            return t.to("cpu", copy=True)
        return t

    def _from_mpi(self, out: torch.Tensor) -> torch.Tensor:
        """Where MPI writes a result meant for ``out``: ``out`` itself, or a host buffer."""
        if _stage_through_host(out.device, self.cuda_aware):
            return torch.empty(out.shape, dtype=out.dtype)
        return out

    @staticmethod
    def _ready(*buffers: torch.Tensor) -> None:
        """Before MPI touches device memory: finish the queued work that reads or writes it.

        MPI knows nothing of CUDA streams, so the current stream is synchronized.
        """
        for b in buffers:
            if b.device.type == "cuda":
                torch.cuda.current_stream(b.device).synchronize()

    @staticmethod
    def _check_contiguous(op: str, *tensors: torch.Tensor) -> None:
        if not all(t.is_contiguous() for t in tensors):
            raise ValueError(
                f"{op}: MPI needs contiguous tensors; pass t.contiguous() and copy the result back"
            )

    def open_channel(self, name: str) -> bool:
        """Give channel ``name`` a duplicate of this communicator (``Dup``, collective over it;
        :mod:`commopt.comm.channels`)."""
        if name not in self._channels:
            self._channels[name] = self.comm.Dup()
        return True

    def _comm(self) -> Any:
        """The communicator this thread's collectives go over: its channel's, else ``comm``."""
        name = current_channel()
        return self._channels.get(name, self.comm) if name is not None else self.comm

    def _check_reduction(self, t: torch.Tensor, op: ReduceOp) -> None:
        if op not in self._reduce_ops:
            raise ValueError(f"all_reduce: unknown op {op!r}; expected sum, avg, max or min")
        if op == "avg" and not (t.is_floating_point() or t.is_complex()):
            raise ValueError(
                f"all_reduce: op='avg' needs a floating-point tensor, got {t.dtype}; "
                "use op='sum' and divide by world_size yourself"
            )
        self._check_contiguous("all_reduce", t)

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """``Allreduce`` in place (host-staged unless CUDA-aware); "avg" divides after the sum."""
        self._check_reduction(t, op)
        host = self._to_mpi(t)
        self.stats.record("all_reduce", t.numel() * t.element_size(), self.world_size)
        if host.dtype in _HALF:
            work = host.float()  # no half-precision reductions in MPI: reduce in fp32
        else:
            work = host
        mpi_op = self._bool_ops[op] if work.dtype == torch.bool else self._reduce_ops[op]
        self._ready(work)
        self._comm().Allreduce(self._mpi.IN_PLACE, _wire(work), op=mpi_op)
        if op == "avg":
            work.div_(self.world_size)
        if work is not host:
            host.copy_(work)
        if host is not t:
            t.copy_(host)
        return t

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``Allgather`` into out."""
        check_equal_split("all_gather", out, t, self.world_size)
        send, recv = self._to_mpi(t), self._from_mpi(out)
        self.stats.record("all_gather", t.numel() * t.element_size(), self.world_size)
        self._ready(send, recv)
        self._comm().Allgather(_wire(send), _wire(recv))
        if recv is not out:
            out.copy_(recv)
        return out

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``Alltoall`` into out."""
        check_equal_split("all_to_all", out, t, self.world_size)
        send, recv = self._to_mpi(t), self._from_mpi(out)
        self.stats.record("all_to_all", t.numel() * t.element_size(), self.world_size)
        self._ready(send, recv)
        self._comm().Alltoall(_wire(send), _wire(recv))
        if recv is not out:
            out.copy_(recv)
        return out

    # -- non-blocking collectives (commopt.comm.asynchronous) -----------------------------------
    def _posts_directly(self, *tensors: torch.Tensor) -> bool:
        """Whether MPI may be handed these buffers for a non-blocking call (no host staging)."""
        return self.nonblocking and not any(
            _stage_through_host(t.device, self.cuda_aware) for t in tensors
        )

    def all_reduce_async(
        self, t: torch.Tensor, op: ReduceOp = "sum"
    ) -> torch.futures.Future[torch.Tensor]:
        """:meth:`all_reduce` as ``Iallreduce``; the future completes with ``t`` reduced in place
        (for ``"avg"``: the sum, then the same division by ``world_size``)."""
        if not self._posts_directly(t) or t.dtype in _HALF:
            return completed_future(self.all_reduce(t, op))
        self._check_reduction(t, op)
        self.stats.record("all_reduce", t.numel() * t.element_size(), self.world_size)
        mpi_op = self._bool_ops[op] if t.dtype == torch.bool else self._reduce_ops[op]
        self._ready(t)
        request = self._comm().Iallreduce(self._mpi.IN_PLACE, _wire(t), op=mpi_op)
        n = self.world_size
        return self._progress.submit(request, lambda: t.div_(n) if op == "avg" else t, t.device)

    def all_gather_async(
        self, out: torch.Tensor, t: torch.Tensor
    ) -> torch.futures.Future[torch.Tensor]:
        """:meth:`all_gather` as ``Iallgather``; the future completes with ``out``."""
        return self._move_async("all_gather", out, t)

    def all_to_all_async(
        self, out: torch.Tensor, t: torch.Tensor
    ) -> torch.futures.Future[torch.Tensor]:
        """:meth:`all_to_all` as ``Ialltoall``; the future completes with ``out``."""
        return self._move_async("all_to_all", out, t)

    def _move_async(
        self, op: str, out: torch.Tensor, t: torch.Tensor
    ) -> torch.futures.Future[torch.Tensor]:
        if not self._posts_directly(t, out):
            return completed_future(getattr(self, op)(out, t))
        check_equal_split(op, out, t, self.world_size)
        self.stats.record(op, t.numel() * t.element_size(), self.world_size)
        self._ready(t, out)
        comm = self._comm()
        start = comm.Iallgather if op == "all_gather" else comm.Ialltoall
        request = start(_wire(t), _wire(out))
        # the lambda keeps t alive until MPI is done with it
        return self._progress.submit(request, lambda: (t, out)[1], out.device)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``Bcast`` from ``src``."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src {src} out of range for world size {self.world_size}")
        self._check_contiguous("broadcast", t)
        host = self._to_mpi(t)
        self.stats.record("broadcast", t.numel() * t.element_size(), self.world_size)
        self._ready(host)
        self._comm().Bcast(_wire(host), root=src)
        if host is not t:
            t.copy_(host)
        return t

    def barrier(self) -> None:
        """``Barrier``."""
        self.stats.record("barrier", 0, self.world_size)
        self._comm().Barrier()

    def __repr__(self) -> str:
        return (
            f"MpiBackend(rank={self.rank}, world_size={self.world_size}, "
            f"cuda_aware={self.cuda_aware})"
        )
