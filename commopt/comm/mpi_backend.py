"""MPI through mpi4py as a commopt backend.

CPU tensors are handed to MPI as buffers without copies (mpi4py reads them through DLPack).
CUDA tensors are staged through pinned host memory unless ``cuda_aware=True``, in which case the
device pointer goes straight to MPI — only correct with a CUDA-aware MPI build, which commopt
cannot verify for you. MPI has no bfloat16 or float16 reduction, so reductions of those dtypes
run in float32 and are cast back; data movement (gather, all-to-all, broadcast) is bitwise and
works for every dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from commopt.comm.base import CommStats, ReduceOp, check_equal_split

__all__ = ["MpiBackend"]


def _import_mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as err:  # pragma: no cover - exercised only without mpi4py
        raise ImportError("MpiBackend needs mpi4py: pip install 'commopt[mpi]'") from err
    return MPI


class MpiBackend:
    """Collectives through mpi4py on ``comm`` (default ``MPI.COMM_WORLD``)."""

    name = "mpi"

    def __init__(self, comm: Any = None, *, cuda_aware: bool = False) -> None:
        MPI = _import_mpi()
        self._mpi = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = self.comm.Get_rank()
        self.world_size = self.comm.Get_size()
        self.cuda_aware = cuda_aware
        self.stats = CommStats()
        self._reduce_ops = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}

    # -- buffers -------------------------------------------------------------------------------
    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor MPI reads or writes: ``t`` itself on CPU or with CUDA-aware MPI."""
        if t.device.type == "cpu" or self.cuda_aware:
            return t
        if t.device.type == "cuda":
            # Stage through host memory; the device work producing t must finish first.
            return t.to("cpu", non_blocking=False)
        raise ValueError(f"MpiBackend: unsupported device {t.device}")

    @staticmethod
    def _buf(t: torch.Tensor) -> torch.Tensor:
        """A view MPI can describe: half types travel as 16-bit integers (bitwise, no math)."""
        if t.dtype in (torch.bfloat16, torch.float16):
            return t.view(torch.int16)
        if t.dtype == torch.bool:
            return t.view(torch.uint8)
        return t

    def _back(self, dst: torch.Tensor, host: torch.Tensor) -> None:
        if host is not dst:
            dst.copy_(host)

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        if op not in self._reduce_ops:
            raise ValueError(f"all_reduce: unknown op {op!r}; expected sum, avg, max or min")
        self.stats.record("all_reduce", t.numel() * t.element_size(), self.world_size)
        host = self._host(t)
        work = host.float() if host.dtype in (torch.bfloat16, torch.float16) else host
        if not work.is_contiguous():
            raise ValueError("all_reduce: tensor must be contiguous")
        self.comm.Allreduce(self._mpi.IN_PLACE, self._buf(work), op=self._reduce_ops[op])
        if op == "avg":
            work.div_(self.world_size)
        if work is not host:
            host.copy_(work)
        self._back(t, host)
        return t

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        check_equal_split("all_gather", out, t, self.world_size)
        self.stats.record("all_gather", t.numel() * t.element_size(), self.world_size)
        host_out = self._host(out) if self.cuda_aware or out.device.type == "cpu" else None
        if host_out is None:
            host_out = torch.empty(out.shape, dtype=out.dtype)
        self.comm.Allgather(self._buf(self._host(t)), self._buf(host_out))
        self._back(out, host_out)
        return out

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        check_equal_split("all_to_all", out, t, self.world_size)
        self.stats.record("all_to_all", t.numel() * t.element_size(), self.world_size)
        host_out = self._host(out) if self.cuda_aware or out.device.type == "cpu" else None
        if host_out is None:
            host_out = torch.empty(out.shape, dtype=out.dtype)
        self.comm.Alltoall(self._buf(self._host(t)), self._buf(host_out))
        self._back(out, host_out)
        return out

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src {src} out of range for world size {self.world_size}")
        if not t.is_contiguous():
            raise ValueError("broadcast: tensor must be contiguous")
        self.stats.record("broadcast", t.numel() * t.element_size(), self.world_size)
        host = self._host(t)
        self.comm.Bcast(self._buf(host), root=src)
        self._back(t, host)
        return t

    def barrier(self) -> None:
        self.stats.record("barrier", 0, self.world_size)
        self.comm.Barrier()

    def __repr__(self) -> str:
        return f"MpiBackend(rank={self.rank}, world_size={self.world_size}, cuda_aware={self.cuda_aware})"
