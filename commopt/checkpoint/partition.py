"""What goes where: tensors equal on every rank are written once, the rest in each rank's shard.

Every rank hashes each model and optimizer tensor, and the hashes are compared with one
all-reduce; the decision follows the data, not a list of names. The optimizer's ``"commopt"``
section (this rank's error buffers) and ``extra`` always go into the rank's own shard.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch

from commopt.comm import Backend

__all__ = ["Partition", "differs_across_ranks", "host_tree", "partition_state", "to_host"]


def _tensor_hash(t: torch.Tensor) -> int:
    """63-bit hash of a tensor's dtype, shape and bytes (equal tensors hash equal on every rank)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{t.dtype}|{tuple(t.shape)}".encode())
    host = t.detach().to("cpu").contiguous()
    if host.numel():
        h.update(host.reshape(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


def differs_across_ranks(tensors: list[torch.Tensor], names: list[str], be: Backend) -> list[bool]:
    """For each tensor, whether its contents differ between ranks (two small all-reduces).

    If the ranks do not even hold the same list of tensors (state created on some ranks only),
    every tensor counts as per rank: each shard then carries its rank's complete state.
    """
    if be.world_size == 1:
        return [False] * len(tensors)
    h = hashlib.blake2b("\n".join(names).encode(), digest_size=8)
    layout = torch.tensor([len(tensors), int.from_bytes(h.digest(), "little") >> 1])
    both = torch.cat([layout, -layout])
    be.all_reduce(both, "max")
    if not torch.equal(both[:2], -both[2:]):
        return [True] * len(tensors)
    if not tensors:
        return []
    hashes = torch.tensor([_tensor_hash(t) for t in tensors], dtype=torch.int64)
    both = torch.cat([hashes, -hashes])
    be.all_reduce(both, "max")
    k = len(tensors)
    return (both[:k] != -both[k:]).tolist()


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A compact CPU copy (a view of a flat buffer would otherwise save the whole buffer)."""
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    out.copy_(t.detach())
    return out


def host_tree(obj: Any) -> Any:
    """``obj`` with every tensor in its dicts, lists and tuples replaced by :func:`to_host`."""
    if isinstance(obj, torch.Tensor):
        return to_host(obj)
    if isinstance(obj, dict):
        return {k: host_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [host_tree(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(host_tree(v) for v in obj)
    return obj


@dataclasses.dataclass
class Partition:
    """A rank's state split into its own shard and (rank 0 only) the shared file."""

    shard: dict[str, Any]
    """this rank's file: the ``"commopt"`` section, per-rank tensors, ``extra``"""
    shared: dict[str, Any] | None
    """the state equal on every rank (written by rank 0; None on the others)"""
    per_rank_model: list[str]
    """model state keys saved per rank"""
    per_rank_opt: list[tuple[int, str]]
    """(parameter index, key) of the optimizer state saved per rank"""


def partition_state(
    model_sd: dict[str, Any], opt_sd: dict[str, Any], extra: dict[str, Any], be: Backend
) -> Partition:
    """Split the model's and the optimizer's state dicts (and ``extra``) into this rank's shard
    and the shared part; collective (:func:`differs_across_ranks`)."""
    rank, n = be.rank, be.world_size
    opt_sd = dict(opt_sd)
    comm = opt_sd.pop("commopt", None)
    opt_keys = [
        (idx, key)
        for idx, st in opt_sd["state"].items()
        for key, v in st.items()
        if isinstance(v, torch.Tensor)
    ]
    model_keys = [k for k, v in model_sd.items() if isinstance(v, torch.Tensor)]
    tensors = [model_sd[k] for k in model_keys] + [opt_sd["state"][i][k] for i, k in opt_keys]
    names = [f"model/{k}" for k in model_keys] + [f"opt/{i}/{k}" for i, k in opt_keys]
    differs = differs_across_ranks(tensors, names, be)
    per_rank_model = [k for k, d in zip(model_keys, differs[: len(model_keys)], strict=True) if d]
    per_rank_opt = [ik for ik, d in zip(opt_keys, differs[len(model_keys) :], strict=True) if d]

    shard: dict[str, Any] = {
        "rank": rank,
        "world_size": n,
        "commopt": host_tree(comm),
        "model": {k: to_host(model_sd[k]) for k in per_rank_model},
        "optimizer_state": {},
        "extra": host_tree(extra),
    }
    for idx, key in per_rank_opt:
        shard["optimizer_state"].setdefault(idx, {})[key] = to_host(opt_sd["state"][idx][key])

    shared: dict[str, Any] | None = None
    if rank == 0:
        shared = {
            "model": {
                k: (to_host(v) if isinstance(v, torch.Tensor) else v)
                for k, v in model_sd.items()
                if k not in per_rank_model
            },
            "optimizer": {
                "state": {
                    idx: {
                        key: (to_host(v) if isinstance(v, torch.Tensor) else v)
                        for key, v in st.items()
                        if (idx, key) not in per_rank_opt
                    }
                    for idx, st in opt_sd["state"].items()
                },
                "param_groups": host_tree(opt_sd["param_groups"]),
            },
        }
    return Partition(shard, shared, per_rank_model, per_rank_opt)
