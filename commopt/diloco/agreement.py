"""Every rank checks that every other rank built the same outer loop, before any sync can hang.

Ranks that disagree on ``sync_every`` would enter the pseudo-gradient's collectives at
different steps: one rank waits in a collective the others never start (or, worse, pairs it
with a later, unrelated one). One all-gather of a few integers when the loop is built turns
that into a ``ValueError`` on every rank that names the setting and each rank's value.

Ranks that step in lockstep are a quieter mistake: a ``DistributedDataParallel`` model averages
every gradient in ``backward()``, so each inner step is already a data-parallel step, every rank's
pseudo-gradient is the same, and the outer loop adds its syncs to DDP's traffic instead of
replacing it. :func:`warn_if_in_lockstep` looks for that at the first sync.
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor

from commopt.comm import Backend

__all__ = [
    "LOCKSTEP_MESSAGE",
    "agree",
    "agree_on_steps",
    "check_shards",
    "float_bits",
    "rows_at_step",
    "warn_if_in_lockstep",
]


def float_bits(x: float) -> int:
    """The IEEE-754 binary64 bits of ``x`` as an int64 (so floats compare exactly)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def agree(backend: Backend, fields: Mapping[str, int], what: str) -> None:
    """Raise ``ValueError`` on every rank unless every rank passed the same ``fields``.

    Args:
        backend: the ranks that must agree (one all-gather of ``len(fields)`` int64 per rank).
        fields: setting name → integer value (floats through :func:`float_bits`).
        what: the object being built, for the message.
    """
    if backend.world_size == 1:
        return
    names = list(fields)
    rows = _rows(backend, torch.tensor([int(fields[k]) for k in names], dtype=torch.int64))
    differ = [i for i, k in enumerate(names) if len({row[i] for row in rows}) > 1]
    if differ:
        detail = "; ".join(
            f"{names[i]}: " + ", ".join(f"rank {r} {row[i]}" for r, row in enumerate(rows))
            for i in differ
        )
        raise ValueError(
            f"{what}: the ranks were built with different settings ({detail}); every rank must "
            "pass the same ones (floats are compared by their bits)"
        )


def agree_on_steps(
    backend: Backend, step: int, what: str, buffers: Sequence[torch.Tensor] = ()
) -> int:
    """Raise ``ValueError`` on every rank unless every rank has taken ``step`` inner steps and
    passed ``buffers`` of as many elements (:func:`rows_at_step`); returns the bytes this rank
    sent."""
    before = backend.stats.snapshot()
    numel = sum(b.numel() for b in buffers)
    rows = rows_at_step(backend, step, what, numel)
    if len({row[1] for row in rows}) > 1:
        sizes = ", ".join(f"rank {r} {row[1]}" for r, row in enumerate(rows))
        raise ValueError(
            f"{what}: the ranks passed floating-point buffers of different sizes ({sizes} "
            "elements); pass the same model's buffers on every rank"
        )
    return (backend.stats.snapshot() - before).bytes_sent


def rows_at_step(backend: Backend, step: int, what: str, *fields: int) -> list[list[int]]:
    """Every rank's ``fields`` (up to two integers), once every rank is known to be at inner
    step ``step``: one all-gather of three int64 per rank.

    Each of DiLoCo's collective moments (a sync, the warmup's and the islands' averaging,
    ``finish()``) begins with this same collective, so a rank that ran out of data (in
    ``finish()``) and one still training meet in it and both raise; two different collectives
    would pair with each other instead (gloo aborts the process, NCCL waits for ever).

    Raises:
        ValueError: on every rank, naming each rank's step, when they differ.
    """
    mine = [step, *fields, 0, 0][:3]
    rows = _rows(backend, torch.tensor(mine, dtype=torch.int64))
    if len({row[0] for row in rows}) > 1:
        steps = ", ".join(f"rank {r} {row[0]}" for r, row in enumerate(rows))
        raise ValueError(
            f"{what}: the ranks took different numbers of inner steps ({steps}); every rank "
            "must call step() as often (the same number of batches on every rank: a "
            "DistributedSampler, drop_last=True)"
        )
    return rows


def _rows(backend: Backend, mine: torch.Tensor) -> list[list[int]]:
    """Every rank's ``mine`` (1-D int64, the same length everywhere), in rank order: one
    all-gather on ``mine``'s device (none for one rank)."""
    n = backend.world_size
    if n == 1:
        return [mine.tolist()]
    table = torch.empty(n * mine.numel(), dtype=torch.int64, device=mine.device)
    backend.all_gather(table, mine)
    return table.view(n, -1).tolist()


#: the warning of :func:`warn_if_in_lockstep` (``{n}``: the number of ranks)
LOCKSTEP_MESSAGE = (
    "DiLoCo: at the first sync the pseudo-gradients of all {n} ranks were bit-identical, so the "
    "inner steps ran in lockstep. Either the gradients were averaged in backward, as a "
    "DistributedDataParallel model does on every step (leave them local: "
    "model.register_comm_hook(None, torch.distributed.algorithms.ddp_comm_hooks."
    "debugging_hooks.noop_hook)), or every rank trained on the same data. Either way the "
    "syncs add traffic and change nothing (docs/algorithms/diloco.md, 'Under DDP')."
)


def warn_if_in_lockstep(backend: Backend, delta: torch.Tensor) -> bool:
    """Warn (``UserWarning``, on every rank) when every rank's ``delta`` holds the same bits and
    is finite and not all zero; return whether it did. One all-gather of three int64 per rank:
    the sum of the elements' bit patterns, the count of nonzero elements and whether all are
    finite, a digest (ranks whose digests collide without equal bits would be warned wrongly;
    nothing else changes). Identical NaNs are no lockstep: the sync raises
    :class:`~commopt.compressed.NonFiniteError` next."""
    n = backend.world_size
    if n == 1:
        return False
    bits = delta.view(torch.int32)
    digest = [bits.sum(dtype=torch.int64), torch.count_nonzero(bits), delta.isfinite().all()]
    rows = _rows(backend, torch.stack([d.to(torch.int64) for d in digest]))
    if rows[0][1] > 0 and rows[0][2] == 1 and all(row == rows[0] for row in rows):
        warnings.warn(LOCKSTEP_MESSAGE.format(n=n), UserWarning, stacklevel=4)
        return True
    return False


def check_shards(backend: Backend, params: list[torch.Tensor]) -> bool:
    """Whether ``params`` are FSDP2 shards (DTensors), after checking that DiLoCo can average
    them: all sharded over one 1-D mesh, and every rank of ``backend`` holding the same shard
    (its replicate group), so that rank r's element k is rank s's element k. One all-gather of
    two int64 per rank.

    Raises:
        ValueError: some parameters sharded and some not, a mesh that is not one 1-D mesh
            (FSDP2's native HSDP all-reduces every gradient across the replicas), or ranks
            of ``backend`` that hold different shards (the whole job's backend, say).
    """
    sharded = [isinstance(p, DTensor) for p in params]
    if not any(sharded):
        return False
    if not all(sharded):
        raise ValueError(
            f"DiLoCo: {sharded.count(False)} of {len(params)} parameters are not FSDP2 shards; "
            "shard the whole model (fully_shard) before building the inner optimizer"
        )
    meshes = {p.device_mesh for p in params}  # type: ignore[attr-defined]
    mesh = meshes.pop() if len(meshes) == 1 else None
    if mesh is None or mesh.ndim != 1:
        raise ValueError(
            "DiLoCo: the parameters must be sharded over one 1-D mesh, fully_shard(module, "
            "mesh=mesh['shard']); FSDP2 on a 2-D mesh (its native HSDP) all-reduces every "
            "gradient across the replicas, which would make every inner step a data-parallel one"
        )
    rows = _rows(backend, torch.tensor([mesh.get_local_rank(), mesh.size()], dtype=torch.int64))
    if any(row != rows[0] for row in rows):
        shards = ", ".join(f"rank {r} shard {row[0]} of {row[1]}" for r, row in enumerate(rows))
        raise ValueError(
            f"DiLoCo: the ranks of its backend hold different FSDP2 shards ({shards}); "
            "build it over the ranks that hold the same shard: "
            "backend=commopt.TorchBackend(mesh.get_group('replicate')), or on MPI an "
            "MpiBackend(comm.Split(shard_index, replica_index))"
        )
    return True
