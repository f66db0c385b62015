r"""Collectives through one shared-memory segment, for ranks that share a host.

Meant for the local level of :class:`commopt.exchange.HierarchicalExchange` when nothing
faster is at hand (no NVLink, no shared-memory MPI): the ranks of a node exchange their fp32
slices by writing into and reading from one ``/dev/shm`` mapping — one copy in, one copy out —
instead of pushing them through TCP loopback. A *helper* backend over the same ranks (a gloo
process group of the node, say) carries the few small messages: the segment's name when it is
(re)created, and the barriers. Every collective is: write my part, barrier, read what I need.
The segment has two halves used in turn, so the next collective writes where nobody can still
be reading (the one after that reuses this half, but only past its own barrier, which a rank
reaches only once it has read this one): one barrier per collective, not two.

Results are bit-identical to any other backend's: data are moved bytewise, and ``all_reduce``
sums in rank order. :meth:`SharedMemoryBackend.reduce_scatter_mean_` is the hierarchical
exchange's local reduce-scatter done in place: a rank writes only the rows others need and sums
straight out of the segment. With ``fallback=True`` a message that does not fit in /dev/shm goes
through the helper instead (one warning), so a small tmpfs slows the job rather than stopping
it. CPU tensors only. Bytes are counted with the cost model of
:mod:`commopt.comm.base`, as for every backend.
"""

from __future__ import annotations

import os
import tempfile
import uuid
import warnings

import torch

from commopt.comm.base import Backend, CommStats, ReduceOp, check_equal_split

__all__ = ["SharedMemoryBackend", "shared_memory_usable"]

_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def shared_memory_usable() -> bool:
    """Whether this host has a writable /dev/shm (a RAM-backed tmpfs on Linux) to map."""
    return os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK)


class SharedMemoryBackend:
    """Collectives of ``helper``'s ranks through a shared mapping; they must share a host.

    Args:
        helper: a backend over exactly the ranks that share the segment (same rank numbers);
            used for barriers and to tell everyone the segment's name.
        fallback: when /dev/shm has no room for a message, send it through ``helper`` (warned
            once) instead of raising ``RuntimeError``. The node's rank 0 decides for all of
            them, so they always take the same path.
    """

    name = "shm"

    def __init__(self, helper: Backend, *, fallback: bool = False) -> None:
        self.helper = helper
        self.fallback = fallback
        self._warned = False
        self.rank = helper.rank
        self.world_size = helper.world_size
        self.stats = CommStats()
        self._segment = torch.empty(0, dtype=torch.uint8)
        self._half = 0  # which half of the segment the next collective uses

    # -- the segment -------------------------------------------------------------------------
    def _slots(self, slot_bytes: int) -> torch.Tensor | None:
        """A [world_size, slot_bytes] view of the next half of the segment, which is grown
        (collectively) when needed; ``None`` (with ``fallback``) when /dev/shm has no room."""
        half = self.world_size * slot_bytes
        need = 2 * half
        if self._segment.numel() < need:
            name = torch.zeros(128, dtype=torch.uint8)
            path = ""
            if self.rank == 0:
                # A tmpfs too small (Docker's default /dev/shm is 64 MB) would crash the ranks
                # with SIGBUS on first touch: check first, and tell everyone (empty name).
                st = os.statvfs(_SHM_DIR)
                if st.f_bavail * st.f_frsize >= need:
                    path = os.path.join(_SHM_DIR, f"commopt-shm-{uuid.uuid4().hex}")
                    encoded = path.encode()
                    name[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
                    torch.from_file(path, shared=True, size=need, dtype=torch.uint8)  # creates it
            self.helper.broadcast(name, 0)
            if not bool(name.any()):
                if self.fallback:
                    if not self._warned:
                        self._warned = True
                        warnings.warn(
                            f"SharedMemoryBackend: {_SHM_DIR} has less than the {need} bytes "
                            "free that a message needs; such messages go through the node's "
                            f"{type(self.helper).__name__} instead (slower; enlarge /dev/shm)",
                            stacklevel=3,
                        )
                    return None
                raise RuntimeError(
                    f"SharedMemoryBackend: {_SHM_DIR} has less than the {need} bytes free that "
                    "a segment for this message needs; enlarge it (docker run --shm-size) or "
                    "use the node's process group as the local level"
                )
            path = bytes(name[name != 0].tolist()).decode()
            self._segment = torch.from_file(path, shared=True, size=need, dtype=torch.uint8)
            self.helper.barrier()  # everyone has it mapped: the name can go
            if self.rank == 0:
                os.unlink(path)
        start = self._half * (self._segment.numel() // 2)
        self._half ^= 1
        return self._segment[start : start + half].view(self.world_size, slot_bytes)

    @staticmethod
    def _bytes(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":
            raise ValueError(f"SharedMemoryBackend takes CPU tensors, got one on {t.device}")
        if not t.is_contiguous():
            raise ValueError("SharedMemoryBackend needs contiguous tensors")
        return t.reshape(-1).view(torch.uint8)

    # -- collectives ---------------------------------------------------------------------------
    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Each rank copies t into its slot of the shared segment and every rank reads all
        slots (through the helper backend where t does not fit the segment)."""
        check_equal_split("all_gather", out, t, self.world_size)
        self.stats.record("all_gather", t.numel() * t.element_size(), self.world_size)
        return self._gather(out, t)

    def _gather(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        src = self._bytes(t)
        slots = self._slots(src.numel())
        if slots is None:
            return self.helper.all_gather(out, t)
        slots[self.rank].copy_(src)
        self.helper.barrier()
        self._bytes(out).view(self.world_size, -1).copy_(slots)
        return out

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Each rank writes its chunks into the shared segment; every rank reads its own."""
        check_equal_split("all_to_all", out, t, self.world_size)
        self.stats.record("all_to_all", t.numel() * t.element_size(), self.world_size)
        src = self._bytes(t)
        n = self.world_size
        slots = self._slots(src.numel())
        if slots is None:
            return self.helper.all_to_all(out, t)
        slots[self.rank].copy_(src)  # row j of my input is for rank j
        self.helper.barrier()
        chunk = src.numel() // n
        mine = slots.view(n, n, chunk)[:, self.rank]  # row r of every rank's input
        self._bytes(out).view(n, chunk).copy_(mine)
        return out

    def reduce_scatter_mean_(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """out ← the mean over ranks of row ``rank`` of x̄, where x̄ = ``t`` zero-padded to
        ``world_size·out.numel()`` fp32 elements viewed as [world_size, out.numel()].

        The result equals an all_to_all of x̄ followed by (row 0 + row 1 + …) / world_size in
        rank order, bit for bit; but a rank writes only the rows the others need (its own stays
        put unless it holds padding) and sums straight out of the segment: one copy in, one
        pass of reading, and no padded copy of ``t``. Counted as that all_to_all.
        """
        n, width = self.world_size, out.numel()
        total = n * width
        if t.dtype != torch.float32 or out.dtype != torch.float32:
            raise TypeError("reduce_scatter_mean_ takes float32 tensors")
        if t.numel() > total or not out.is_contiguous():
            raise ValueError(
                f"reduce_scatter_mean_: {t.numel()} elements do not fit {n} rows of {width}, "
                "or out is not contiguous"
            )
        self._bytes(t)  # CPU and contiguous
        self.stats.record("all_to_all", 4 * total, n)
        slots = self._slots(4 * total)
        src = t.reshape(-1)
        if slots is None:  # through the helper: pad, all_to_all, sum in rank order
            padded = torch.zeros(total)
            padded[: src.numel()] = src
            rows = torch.empty(n, width)
            self.helper.all_to_all(rows, padded.view(n, width))
        else:
            mine = slots[self.rank].view(torch.float32)
            numel = src.numel()
            own_whole = (self.rank + 1) * width <= numel
            for r in range(n):
                if r == self.rank and own_whole:
                    continue
                lo, hi = r * width, min((r + 1) * width, numel)
                if hi > lo:
                    mine[lo:hi].copy_(src[lo:hi])
                mine[max(lo, hi) : (r + 1) * width].zero_()
            self.helper.barrier()
            rows = slots.view(torch.float32).view(n, n, width)[:, self.rank]
            if own_whole:
                rows = [*rows]
                rows[self.rank] = src[self.rank * width : (self.rank + 1) * width]
        if n == 1:
            out.copy_(rows[0])
        else:
            torch.add(rows[0], rows[1], out=out)
        for r in range(2, n):
            out.add_(rows[r])
        return out.div_(n)

    def all_reduce(self, t: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduced through the shared segment, summed in rank order on every rank."""
        if op not in ("sum", "avg", "max", "min"):
            raise ValueError(f"all_reduce: unknown op {op!r}; expected sum, avg, max or min")
        self.stats.record("all_reduce", t.numel() * t.element_size(), self.world_size)
        gathered = torch.empty((self.world_size, *t.shape), dtype=t.dtype)
        self._gather(gathered, t.contiguous())
        acc = gathered[0].clone()
        for i in range(1, self.world_size):  # rank order: the same bits everywhere
            if op in ("sum", "avg"):
                acc += gathered[i]
            elif op == "max":
                torch.maximum(acc, gathered[i], out=acc)
            else:
                torch.minimum(acc, gathered[i], out=acc)
        if op == "avg":
            acc /= self.world_size
        t.copy_(acc)
        return t

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src`` writes t into the shared segment; the others read it."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src {src} out of range for world size {self.world_size}")
        self.stats.record("broadcast", t.numel() * t.element_size(), self.world_size)
        data = self._bytes(t)
        slots = self._slots(data.numel())
        if slots is None:
            return self.helper.broadcast(t, src)
        if self.rank == src:
            slots[src].copy_(data)
        self.helper.barrier()
        if self.rank != src:
            data.copy_(slots[src])
        return t

    def barrier(self) -> None:
        """The segment's barrier."""
        self.stats.record("barrier", 0, self.world_size)
        self.helper.barrier()

    def __repr__(self) -> str:
        return f"SharedMemoryBackend(rank={self.rank}, world_size={self.world_size})"
