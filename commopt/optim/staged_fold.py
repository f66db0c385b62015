"""One parameter's gradient into a bucket's staged momentum, bit for bit as ``step()`` would.

The early work of :mod:`commopt.optim.early` (DDP hook, ``overlap=True``) folds each gradient
as it arrives into a staged buffer laid out like the optimizer bucket. Its result must be the
standalone optimizer's to the bit, so :func:`fold_param_` uses the same kernels as the
algorithms' ``step()``: ``lerp`` (``adam_math.momentum_from_grads_``, 1-bit LAMB's
``update_moments_``), m·β1 for 1-bit Adam's parameters without a gradient, and for 0/1 Adam's
1-bit steps the gradient itself (0 without one, as ``FlatState.gather_grads``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from commopt.optim.flat_state import FlatState

if TYPE_CHECKING:
    from commopt.optim.base import CompressedOptimizer

__all__ = ["fold_param_"]


def fold_param_(
    opt: CompressedOptimizer,
    state: FlatState,
    i: int,
    g: torch.Tensor | None,
    staged: torch.Tensor,
    gradient: bool,
) -> None:
    """The bucket's i-th parameter into ``staged`` (flat, the bucket's layout): m' = β1·m +
    (1−β1)·g from the committed m, or ``gradient`` (0/1 Adam's 1-bit steps): g itself.
    ``g`` None: the parameter has no gradient on this rank."""
    bucket = state.bucket
    start = bucket.offsets[i]
    p = bucket.params[i]
    dst = staged[start : start + p.numel()].view(p.shape)
    if gradient:
        if g is None:
            dst.zero_()
        else:
            dst.copy_(g.reshape(p.shape))
        return
    src = state.flat["exp_avg"][start : start + p.numel()].view(p.shape)
    beta1 = _beta1_of(opt, state, i)
    # one pass, out of place: the kernels of lerp_/mul_, so the same bits
    if g is None and opt._fold_missing_as_zero:
        torch.lerp(src, torch.zeros_like(dst), 1 - beta1, out=dst)
    elif g is None:
        torch.mul(src, beta1, out=dst)
    else:
        torch.lerp(src, g.reshape(p.shape).to(dst.dtype), 1 - beta1, out=dst)


def _beta1_of(opt: CompressedOptimizer, state: FlatState, i: int) -> float:
    """β1 of the bucket's i-th parameter (its param group's)."""
    p = state.bucket.params[i]
    for seg, group in opt.segments(state):
        if any(q is p for q in seg.params):
            return group["betas"][0]
    raise IndexError(i)
