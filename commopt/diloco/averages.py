r"""How the workers average a pseudo-gradient: fp32, bf16, or the error-compensated 1-bit exchange.

Each average replaces a 1-D fp32 buffer Δ (this worker's pseudo-gradient, L elements) by
(1/n)·Σ_r Δ_r, bit-identical on every rank, or raises
:class:`~commopt.compressed.NonFiniteError` on every rank, before any state has changed, when
some rank's Δ holds inf/NaN. Persistent per-rank state (the 1-bit exchange's error buffers) is
named by ``state_numels(L)`` and kept by the caller, as the optimizers keep theirs.

=========== ======================================================= ===========================
name        what travels (bytes one rank sends, ring cost model)     state per rank
=========== ======================================================= ===========================
``"none"``  fp32 all-reduce: 2·(n−1)/n·4L                           none
``"bf16"``  bf16 reduce-scatter (all-to-all) summed in fp32, then   none
            a bf16 all-gather: 2·(n−1)/n·2L
``"onebit"`` SPEC §1 (flat) or the hierarchical exchange:           worker and server errors
            ≈ 2·(n−1)/n·L/8
=========== ======================================================= ===========================

``"bf16"`` rounds each rank's Δ to bf16 once, sums the n rounded values in fp32 in rank order
on the rank that owns the slice, and rounds the mean to bf16 once more; every rank then holds
the owner's bits. An all-reduce *in* bf16 would instead round after every partial sum.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.distributed.tensor import DTensor

from commopt.comm import Backend
from commopt.compressed import NonFiniteError
from commopt.diloco.agreement import rows_at_step
from commopt.exchange import Exchange

__all__ = [
    "Bf16Average",
    "Fp32Average",
    "OnebitAverage",
    "PseudoGradientAverage",
    "average_buffers_",
    "average_gradients_",
    "average_tensors_",
    "check_finite",
    "local_shard",
]


class PseudoGradientAverage(Protocol):
    """The contract between :class:`~commopt.diloco.DiLoCo` and one way of averaging Δ."""

    name: str
    #: every backend the average communicates on, by level: ``"global"``, and for a
    #: hierarchical exchange ``"local"`` (inside a node) and ``"cross"`` (between nodes)
    backends: dict[str, Backend]

    def state_numels(self, numel: int) -> dict[str, int]:
        """Per-rank fp32 buffers (name → element count) for a Δ of ``numel`` elements."""
        ...

    def average_(self, delta: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Replace ``delta`` (1-D fp32) by the mean over ranks, in place; ``state`` updated."""
        ...


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's local tensor (an FSDP2 shard, which DiLoCo
    averages with the ranks that hold the same shard), any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def check_finite(backend: Backend, delta: torch.Tensor) -> None:
    """Raise :class:`NonFiniteError` on every rank, naming the ranks, unless every rank's
    ``delta`` is finite (one all-gather of n flags)."""
    ok = bool(torch.isfinite(delta).all())
    n = backend.world_size
    if n == 1:
        bad = [] if ok else [0]
    else:
        flags = torch.empty(n, dtype=torch.int32, device=delta.device)
        backend.all_gather(
            flags, torch.tensor([int(not ok)], dtype=torch.int32, device=delta.device)
        )
        bad = [r for r, f in enumerate(flags.tolist()) if f]
    if bad:
        raise NonFiniteError(bad)


class _Stateless:
    """An average that keeps nothing of its own between syncs, over one backend."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.backends = {"global": backend}

    def state_numels(self, numel: int) -> dict[str, int]:
        """No per-rank state."""
        return {}


class Fp32Average(_Stateless):
    """Δ ← (1/n)·Σ Δ_r by one fp32 all-reduce: DiLoCo as published (Douillard et al., 2023)."""

    name = "none"

    def average_(self, delta: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Δ ← the fp32 mean of Δ over ranks."""
        check_finite(self.backend, delta)
        if self.backend.world_size > 1:
            self.backend.all_reduce(delta, "avg")


class Bf16Average(_Stateless):
    r"""Δ ← bf16((1/n)·Σ_r bf16(Δ_r)), the sum in fp32 (module docstring).

    With N = L rounded up to a multiple of n and S = N/n, rank j owns slice j: one all-to-all of
    the bf16 slices (row r of what rank j receives is rank r's slice j), the fp32 sum over r in
    rank order, the mean rounded to bf16, one all-gather of the n bf16 slices. The bf16 tensors
    travel as bytes, which every backend moves.
    """

    name = "bf16"

    def average_(self, delta: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Δ ← the mean over ranks of Δ rounded to bf16 (summed in fp32)."""
        be, n, numel = self.backend, self.backend.world_size, delta.numel()
        check_finite(be, delta)
        if n == 1:
            delta.copy_(delta.to(torch.bfloat16))
            return
        slice_numel = -(-numel // n)
        mine = torch.zeros(n * slice_numel, dtype=torch.bfloat16, device=delta.device)
        mine[:numel].copy_(delta)
        rows = torch.empty_like(mine)
        be.all_to_all(rows.view(torch.uint8), mine.view(torch.uint8))
        total = rows.view(n, slice_numel).float().sum(dim=0)  # rank order, in fp32
        own = total.div_(n).to(torch.bfloat16)
        gathered = torch.empty_like(mine)
        be.all_gather(gathered.view(torch.uint8), own.view(torch.uint8))
        delta.copy_(gathered[:numel])


class OnebitAverage:
    """Δ through a 1-bit :class:`~commopt.exchange.Exchange` (SPEC §1, flat or hierarchical):
    the worker and server errors persist per rank from one sync to the next, so what one sync's
    signs fail to say is sent at the next."""

    name = "onebit"

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.backends = {"global": exchange.backend}
        for level in ("local", "cross"):
            be = getattr(exchange, f"{level}_backend", None)
            if be is not None:
                self.backends[level] = be

    def state_numels(self, numel: int) -> dict[str, int]:
        """The exchange's error buffers (worker and server)."""
        return self.exchange.state_numels(numel)

    def average_(self, delta: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Δ ← C(Δ), the error-compensated 1-bit average (SPEC §1) with this rank's errors."""
        self.exchange.allreduce_(delta, state)


@torch.no_grad()
def average_gradients_(
    backend: Backend, params: list[torch.Tensor], step: int, nonfinite: bool = False
) -> tuple[int, bool]:
    """Every gradient ← its fp32 mean over ``backend`` (one all-reduce of one flat buffer): the
    data-parallel steps of DiLoCo's warmup (all ranks) and of its islands (the node). Returns
    the bytes this rank sent, and whether ``nonfinite`` was true on any rank (GradScaler's
    verdict, agreed in the step check of inner step ``step``:
    :func:`~commopt.diloco.agreement.rows_at_step`).

    As DDP with ``find_unused_parameters=True``: a parameter without a gradient on some ranks
    (a branch or an expert their batch did not use) counts as zero there, and gets the mean on
    every rank; one without a gradient anywhere keeps none. A sparse gradient stays sparse,
    over the union of the ranks' rows. One small all-reduce first says, per parameter, whether
    any rank has a gradient and whether it is sparse.

    Raises:
        ValueError: on every rank of ``backend``, when the ranks are at different steps.
    """
    before = backend.stats.snapshot()
    what = f"DiLoCo, averaging the gradients of inner step {step}"
    rows = rows_at_step(backend, step, what, int(nonfinite))
    kinds = torch.tensor([_kind(p.grad) for p in params], dtype=torch.int32)
    backend.all_reduce(kinds, "max")
    dense, sparse = [], []
    for p, kind in zip(params, kinds.tolist(), strict=True):
        if kind == 1:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dense.append(local_shard(p.grad))
        elif kind > 1:
            sparse.append((p, kind - 1))
    densified = [_densified(p, sparse_dim) for p, sparse_dim in sparse]
    average_tensors_(backend, dense + [t for pair in densified for t in pair])
    for (p, _), (values, present) in zip(sparse, densified, strict=True):
        p.grad = _sparsified(values, present)
    return (backend.stats.snapshot() - before).bytes_sent, any(row[1] for row in rows)


def _kind(grad: torch.Tensor | None) -> int:
    """0: no gradient; 1: dense; 1 + its sparse dimensions: sparse."""
    if grad is None:
        return 0
    return 1 + grad.sparse_dim() if grad.is_sparse else 1


# A sparse gradient (nn.Embedding(sparse=True)) is averaged densely, beside a 0/1 mark of the
# rows it holds: the mean then keeps the union of the ranks' rows, each averaged over all n
# ranks (a rank without the row adds zero), which is what DDP's sparse all-reduce gives, and a
# sparse optimizer (SparseAdam) touches exactly those rows. It costs the dense size on the wire.
def _densified(p: torch.Tensor, sparse_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = p.shape[:sparse_dim]
    if p.grad is None:
        return torch.zeros_like(p), torch.zeros(rows, device=p.device)
    if not p.grad.is_sparse:
        return p.grad, torch.ones(rows, device=p.device)
    grad = p.grad.coalesce()
    present = torch.zeros(rows, device=p.device)
    present[tuple(grad.indices())] = 1.0
    return grad.to_dense(), present


def _sparsified(values: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    indices = present.nonzero().t()
    return torch.sparse_coo_tensor(indices, values[tuple(indices)], values.shape, is_coalesced=True)


def average_buffers_(backend: Backend, buffers: list[torch.Tensor]) -> int:
    """``buffers`` (floating point: BatchNorm's running statistics) averaged over ``backend``
    in float64 (:func:`average_tensors_`); every rank passes the same sizes. DiLoCo syncs
    parameters, and each rank's buffers followed its own data and weights: this makes them one
    at the end of training. float64 keeps a buffer that is the same on every rank (a constant,
    a rotary cache) bit for bit: an fp32 mean of three equal values is not always that value.
    Returns the bytes this rank sent (none for no buffers)."""
    before = backend.stats.snapshot()
    average_tensors_(backend, buffers, torch.float64)
    return (backend.stats.snapshot() - before).bytes_sent


def average_tensors_(
    backend: Backend, tensors: list[torch.Tensor], dtype: torch.dtype = torch.float32
) -> None:
    """Each of ``tensors`` ← its mean over ``backend``, computed in ``dtype``: one all-reduce
    of one flat buffer (nothing for no tensors)."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
    backend.all_reduce(flat, "avg")
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
