"""Per-tensor quantities of a flat bucket: LAMB works tensor by tensor (norms, trust ratios,
scaling coefficients) on buffers that hold many tensors back to back."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from commopt.buckets import Bucket
from commopt.optim.flat_state import FlatState

if TYPE_CHECKING:
    from commopt.optim.base import CompressedOptimizer

__all__ = ["per_tensor", "scale_tensors_", "tensor_norms", "tensor_ranges"]


def per_tensor(
    reduce: Callable[[list[torch.Tensor]], tuple[torch.Tensor, ...]],
    views: list[torch.Tensor],
    empty: float,
    device: torch.device,
) -> torch.Tensor:
    """One fp32 value per tensor: ``reduce`` over the non-empty views, ``empty`` for the rest."""
    out = torch.full((len(views),), empty, device=device)
    index = [i for i, v in enumerate(views) if v.numel()]
    if index:
        out[index] = torch.stack(reduce([views[i] for i in index])).float()
    return out


def tensor_norms(bucket: Bucket, flat: torch.Tensor) -> torch.Tensor:
    """‖x_k‖₂ of every tensor k of the bucket (0 for empty tensors)."""
    return per_tensor(torch._foreach_norm, bucket.views(flat), 0.0, flat.device)


def scale_tensors_(
    bucket: Bucket, flat: torch.Tensor, per_tensor: torch.Tensor, divide: bool = False
) -> None:
    """x_k ← x_k·per_tensor[k] (or x_k/per_tensor[k]) for every tensor k, in place.

    The same fp32 operation per element as with per_tensor expanded to the bucket's length,
    without writing that N-element buffer first.
    """
    scale_ = torch._foreach_div_ if divide else torch._foreach_mul_
    scale_(bucket.views(flat), list(per_tensor.unbind()))


def tensor_ranges(opt: CompressedOptimizer, state: FlatState) -> list[tuple[dict[str, Any], slice]]:
    """Each segment's param group and its tensors' range in the per-tensor scalars."""
    out, first = [], 0
    for seg, group in opt.segments(state):
        out.append((group, slice(first, first + len(seg.params))))
        first += len(seg.params)
    return out
