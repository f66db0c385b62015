r"""Parameters sharded S ways inside a group of ranks and replicated R ways across groups.

ZeRO-3 / FSDP keeps 1/S of every parameter, gradient and optimizer state on each of the S ranks
of a *shard group* (ranks that share a fast link); HSDP repeats that layout on R such groups
and averages across them over the slow network. An optimizer that steps sharded parameters
sees only its rank's shard of each tensor (:func:`local`), and needs two groups of ranks:

- the *replicate* group, the R ranks that hold the same shard: where the gradient is averaged
  at full precision (warmup) and where the 1-bit exchange runs, on this rank's shard alone;
- the *shard* group, the S ranks that hold one replica between them: where per-tensor
  quantities (1-bit LAMB's norms) are summed, since each rank has only a piece of a tensor.

:class:`Sharding` names both. :mod:`commopt.fsdp` builds it from an FSDP2 device mesh and hands
it to the optimizer (``optimizer.shard_over(sharding)``); docs/fsdp.md tells the whole story.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from commopt.comm import Backend

__all__ = ["Sharding", "local", "refuse_unattached_shards", "unlike_shards", "unshardable"]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (a DTensor), sharing its storage; ``t`` itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclasses.dataclass(frozen=True)
class Sharding:
    """The two groups a sharded optimizer talks over (see the module docstring).

    Args:
        replicate: the R ranks holding this rank's shard, one per replica, in replica order.
        shard: the S ranks holding this rank's replica, in shard order.
    """

    replicate: Backend
    shard: Backend

    @property
    def name(self) -> str:
        """``"sharded:RxS:i.j"``: R replicas of S shards, this rank replica i's shard j. The
        exchange's buffers are saved under it: they mean something only in that layout."""
        r, s = self.replicate, self.shard
        return f"sharded:{r.world_size}x{s.world_size}:{r.rank}.{s.rank}"

    def sum_over_shards_(self, t: torch.Tensor) -> torch.Tensor:
        """t ← Σ over the shard group (per-tensor partial sums become whole-tensor sums)."""
        if self.shard.world_size > 1:
            self.shard.all_reduce(t, "sum")
        return t

    def max_over_shards_(self, t: torch.Tensor) -> torch.Tensor:
        """t ← max over the shard group (per-tensor partial maxima become whole-tensor ones)."""
        if self.shard.world_size > 1:
            self.shard.all_reduce(t, "max")
        return t


def unshardable(steps: int, topology: str, groups: list[dict[str, Any]]) -> str | None:
    """Why an optimizer that has taken ``steps`` steps, with ``topology``, over ``groups``
    cannot switch to sharded parameters now; None: it can."""
    if steps > 0:
        return (
            f"it has taken {steps} steps already; attach before the first step "
            "(and load a checkpoint after attaching)"
        )
    if topology != "flat":
        return (
            f"topology={topology!r}: with sharded parameters the shard group is the "
            "node level already (full precision inside it, one bit between replicas); leave "
            "topology='flat'"
        )
    for group in groups:
        if group.get("exp_avg_mask") is not None:
            return "exp_avg_mask has no sharded form; remove it from the param group"
        for p in group["params"]:
            if p.dtype != torch.float32:
                return (
                    f"a {p.dtype} sharded parameter (shape {tuple(p.shape)}): keep the sharded "
                    "parameters fp32 and compute in low precision with FSDP2's "
                    "MixedPrecisionPolicy(param_dtype=torch.bfloat16)"
                )
    return None


def unlike_shards(params: list[torch.Tensor], like: torch.Tensor) -> str | None:
    """Why ``params``, a group added to an optimizer that steps shards like ``like``, cannot
    join it; None: they can."""
    for p in params:
        if not isinstance(p, DTensor):
            return (
                f"a parameter of shape {tuple(p.shape)} is not sharded (not a DTensor): it "
                "would be averaged over the replicas only, each rank of a shard group keeping "
                "its own copy; shard its module with fully_shard(module, mesh=mesh['shard'])"
            )
        if p.device_mesh != like.device_mesh:  # type: ignore[attr-defined]
            return (
                f"a parameter (shape {tuple(p.shape)}) is sharded over {p.device_mesh}, the "
                f"others over {like.device_mesh}; shard every module over "  # type: ignore[attr-defined]
                "the same mesh['shard']"
            )
    return None


def refuse_unattached_shards(name: str, groups: list[dict[str, Any]]) -> None:
    """ValueError for sharded parameters (DTensors) the optimizer was not told about: it would
    average one rank's shard with other ranks' different shards, a silent wrong answer."""
    for group in groups:
        for p in group["params"]:
            if isinstance(p, DTensor):
                raise ValueError(
                    f"{name}: its parameters are sharded (DTensor, e.g. FSDP2's fully_shard; "
                    f"placements {tuple(p.placements)}): call commopt.fsdp.attach(model, "
                    "optimizer, mesh) before the first step, so that it averages each shard "
                    "with its replicas only (docs/fsdp.md)"
                )
