"""1-bit LAMB's trust ratios from quantities every rank holds alike (no message).

LAMB's ratio c_k = clip(‖p_k‖/‖u_k‖, min_coeff, max_coeff), 1 where either norm is 0. After the
compressed exchange every rank holds the same averaged momentum, frozen variance and
parameters, so u and this ratio are identical on every rank.

``trust_ratio="max"`` keeps the larger of the paper's frozen ratio c̄·f (SPEC §3) and this one.
The exchange's error adds energy to the momentum in expectation, so ‖u‖ is at least the norm of
the update LAMB would compute, and ‖p‖/‖u‖ bounds LAMB's ratio from below: where it rises above
c̄·f, the ratio LAMB would use has grown since the freeze point. docs/algorithms/onebit_lamb.md
gives the measurements.
"""

from __future__ import annotations

import torch

from commopt.buckets import Bucket
from commopt.optim.per_tensor import tensor_norms

__all__ = ["lamb_ratio", "raise_to_lamb_ratio_"]


def lamb_ratio(
    bucket: Bucket, p: torch.Tensor, u: torch.Tensor, min_coeff: float, max_coeff: float
) -> torch.Tensor:
    """clip(‖p_k‖/‖u_k‖, min_coeff, max_coeff) for every tensor k of the bucket (p, u flat fp32
    over it); 1 where either norm is 0."""
    p_norm, u_norm = tensor_norms(bucket, p), tensor_norms(bucket, u)
    ratio = p_norm / torch.where(u_norm > 0, u_norm, 1.0)
    c = ratio.clamp_(min_coeff, max_coeff)
    return torch.where((p_norm > 0) & (u_norm > 0), c, 1.0)


def raise_to_lamb_ratio_(
    coeff: torch.Tensor,
    bucket: Bucket,
    p: torch.Tensor,
    u: torch.Tensor,
    min_coeff: float,
    max_coeff: float,
) -> None:
    """coeff_k ← max(coeff_k, LAMB's ratio of p and u) in place (p, u flat fp32 over the bucket)."""
    torch.maximum(coeff, lamb_ratio(bucket, p, u, min_coeff, max_coeff), out=coeff)
