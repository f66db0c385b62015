"""The backend contract: a handful of collectives on torch tensors, plus a traffic counter.

Every collective is synchronous from the caller's point of view: when the call returns, the
output is ready to read (on GPU, ready on the current stream). Backends hold no algorithm state;
the compressed allreduce and the optimizers own theirs.

Bytes are counted per rank under the textbook cost model of each collective, so that figures
are comparable across backends and with SPEC §7:

=============== ==============================================
operation       bytes sent by this rank for a message of B bytes
=============== ==============================================
all_reduce      2·(n−1)/n·B   (ring: reduce-scatter + all-gather)
all_gather      (n−1)·B       (B = this rank's contribution)
all_to_all      (n−1)/n·B     (B = the whole input; own chunk stays)
broadcast       (n−1)/n·B     (scatter + all-gather)
barrier         0
=============== ==============================================
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Protocol, runtime_checkable

import torch

__all__ = ["OPERATIONS", "Backend", "CommStats", "ReduceOp", "SingleProcessBackend", "model_bytes"]

ReduceOp = Literal["sum", "avg", "max", "min"]
OPERATIONS = ("all_reduce", "all_gather", "all_to_all", "broadcast", "barrier")


def model_bytes(op: str, nbytes: int, world_size: int) -> int:
    """Bytes one rank sends for ``op`` on a message of ``nbytes`` under the module's cost model."""
    n = world_size
    if n <= 1 or op == "barrier":
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * nbytes // n
    if op == "all_gather":
        return (n - 1) * nbytes
    if op in ("all_to_all", "broadcast"):
        return (n - 1) * nbytes // n
    raise ValueError(f"unknown operation {op!r}; expected one of {OPERATIONS}")


@dataclasses.dataclass
class CommStats:
    """Running totals of what a backend sent: calls and modelled bytes, overall and per op."""

    calls: int = 0
    bytes_sent: int = 0
    calls_by_op: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes_by_op: dict[str, int] = dataclasses.field(default_factory=dict)

    def record(self, op: str, nbytes: int, world_size: int) -> None:
        """Count one call of ``op`` on ``nbytes`` bytes and its modelled bytes sent."""
        sent = model_bytes(op, nbytes, world_size)
        self.calls += 1
        self.bytes_sent += sent
        self.calls_by_op[op] = self.calls_by_op.get(op, 0) + 1
        self.bytes_by_op[op] = self.bytes_by_op.get(op, 0) + sent

    def reset(self) -> None:
        """Zero every count."""
        self.calls = 0
        self.bytes_sent = 0
        self.calls_by_op.clear()
        self.bytes_by_op.clear()

    def snapshot(self) -> CommStats:
        """A copy that later calls do not change (subtract two snapshots to measure a region)."""
        return CommStats(
            self.calls, self.bytes_sent, dict(self.calls_by_op), dict(self.bytes_by_op)
        )

    def __sub__(self, other: CommStats) -> CommStats:
        return self._combine(other, -1)

    def __add__(self, other: CommStats) -> CommStats:
        """The counts of two backends together (an optimizer's groups, ``comm_stats()``)."""
        return self._combine(other, 1)

    def _combine(self, other: CommStats, sign: int) -> CommStats:
        ops = set(self.calls_by_op) | set(other.calls_by_op)
        return CommStats(
            self.calls + sign * other.calls,
            self.bytes_sent + sign * other.bytes_sent,
            {k: self.calls_by_op.get(k, 0) + sign * other.calls_by_op.get(k, 0) for k in ops},
            {k: self.bytes_by_op.get(k, 0) + sign * other.bytes_by_op.get(k, 0) for k in ops},
        )


@runtime_checkable
class Backend(Protocol):
    """What the compressed allreduce and the optimizers need from a communication library.

    Tensors are contiguous. ``all_gather`` and ``all_to_all`` take equal-sized pieces only:
    ``out.numel() == world_size * t.numel()`` and, for ``all_to_all``, ``t.shape[0]`` divisible
    by ``world_size`` (rows ``j·k … (j+1)·k − 1`` go to rank ``j``).
    """

    name: str
    rank: int
    world_size: int
    stats: CommStats

    def all_reduce(self, t: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """t ← op over ranks of t, in place (``"avg"``: the mean); returns t."""

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """out ← every rank's t, in rank order (out has world_size·t.numel()); returns out."""

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """out[chunk j] ← rank j's t[chunk of this rank] for every j; returns out."""

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """t ← rank ``src``'s t on every rank; returns t."""

    def barrier(self) -> None:
        """Return once every rank has called it."""


def check_equal_split(op: str, out: torch.Tensor, t: torch.Tensor, world_size: int) -> None:
    """Raise ``ValueError`` unless ``out``/``t`` have the equal-split sizes ``op`` needs."""
    if out.dtype != t.dtype:
        raise ValueError(f"{op}: output dtype {out.dtype} differs from input dtype {t.dtype}")
    if out.numel() != world_size * t.numel() and op == "all_gather":
        raise ValueError(
            f"all_gather: expecting an output of {world_size} x {t.numel()} elements, "
            f"got {out.numel()}"
        )
    if op == "all_to_all":
        if out.numel() != t.numel():
            raise ValueError(f"all_to_all: output has {out.numel()} elements, input {t.numel()}")
        if t.numel() % world_size:
            raise ValueError(
                f"all_to_all: {t.numel()} elements do not split equally over {world_size} ranks"
            )
    if not (out.is_contiguous() and t.is_contiguous()):
        raise ValueError(f"{op}: tensors must be contiguous")


class SingleProcessBackend:
    """A world of one process: every collective is the identity and nothing is sent."""

    name = "single"
    rank = 0
    world_size = 1

    def __init__(self) -> None:
        self.stats = CommStats()

    def all_reduce(self, t: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """The identity (one rank); "avg" included."""
        return t

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """out ← t."""
        check_equal_split("all_gather", out, t, 1)
        out.view(-1).copy_(t.view(-1))
        return out

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """out ← t."""
        check_equal_split("all_to_all", out, t, 1)
        out.copy_(t)
        return out

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """The identity (one rank)."""
        if src != 0:
            raise ValueError(f"broadcast: src {src} out of range for a world of 1")
        return t

    def barrier(self) -> None:
        """Nothing to wait for."""
        return None

    def __repr__(self) -> str:
        return "SingleProcessBackend()"
