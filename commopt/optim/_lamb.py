r"""1-bit LAMB's per-tensor quantities: norms, the scaling coefficients σ, the trust ratios.

LAMB works tensor by tensor (norms, trust ratios, scaling coefficients) on flat buffers that
hold many tensors back to back (:func:`per_tensor`, :func:`tensor_norms`,
:func:`scale_tensors_`).

**σ and the σ-scaled exchange** m ← C(m·σ)/σ (SPEC §3 2, 4–5). At the first compression step,
before that step's update, σ_k = mean_j(ρ_j)/ρ_k with ρ_k = ‖m_k‖/√numel_k is frozen from the
committed momenta of every bucket freezing then (σ_k = 1 where ρ_k = 0; a tensor with no
elements takes no part in the mean). From then on every compressed exchange of the momentum is
scaled by σ around it, so that tensors of very different magnitudes share one bucket's scale
fairly. The exchange runs in ``step()`` or, staged, during backward (DDP hook,
``overlap=True``: :func:`early_sigma`).

**Trust ratios** from quantities every rank holds alike (no message): LAMB's ratio c_k =
clip(‖p_k‖/‖u_k‖, min_coeff, max_coeff), 1 where either norm is 0 (:func:`lamb_ratio`). After
the compressed exchange every rank holds the same averaged momentum, frozen variance and
parameters, so u and this ratio are identical on every rank. ``trust_ratio="max"`` keeps the
larger of the paper's frozen ratio c̄·f (SPEC §3) and this one (:func:`raise_to_lamb_ratio_`).
The exchange's error adds energy to the momentum in expectation, so ‖u‖ is at least the norm
of the update LAMB would compute, and ‖p‖/‖u‖ bounds LAMB's ratio from below: where it rises
above c̄·f, the ratio LAMB would use has grown since the freeze point.
docs/algorithms/onebit_lamb.md gives the measurements.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from commopt.buckets import Bucket, Segment
from commopt.optim.flat_state import FlatState

__all__ = [
    "early_sigma",
    "exchange_scaled_",
    "freeze_scaling_coeffs",
    "lamb_ratio",
    "per_tensor",
    "raise_to_lamb_ratio_",
    "scale_tensors_",
    "scaling_coeffs",
    "tensor_norms",
    "tensor_ranges",
]


def per_tensor(
    reduce: Callable[[list[torch.Tensor]], tuple[torch.Tensor, ...]],
    views: list[torch.Tensor],
    empty: float,
    device: torch.device,
) -> torch.Tensor:
    """One fp32 value per tensor: ``reduce`` over the non-empty views, ``empty`` for the rest."""
    out = torch.full((len(views),), empty, dtype=torch.float32, device=device)
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


def tensor_ranges(
    segments: Iterable[tuple[Segment, dict[str, Any]]],
) -> list[tuple[dict[str, Any], slice]]:
    """Each segment's param group and its tensors' range in the per-tensor scalars."""
    out, first = [], 0
    for seg, group in segments:
        out.append((group, slice(first, first + len(seg.params))))
        first += len(seg.params)
    return out


def scaling_coeffs(states: list[FlatState]) -> list[torch.Tensor]:
    """σ of each of these buckets from their committed momenta (nothing is written)."""
    rms, sizes = [], []
    for state in states:
        bucket = state.bucket
        sizes.append(torch.tensor([p.numel() for p in bucket.params], device=bucket.device))
        rms.append(tensor_norms(bucket, state.flat["exp_avg"]) / sizes[-1].clamp(min=1).sqrt())
    nonempty = [(r[s > 0]).cpu() for r, s in zip(rms, sizes, strict=True)]
    count = sum(len(r) for r in nonempty)
    # ρ of a tensor with no elements is undefined: it takes no part in the mean.
    mean = torch.cat(nonempty).sum() / count if count else torch.tensor(0.0, dtype=torch.float32)
    return [torch.where(r > 0, mean.to(r.device) / torch.where(r > 0, r, 1.0), 1.0) for r in rms]


def freeze_scaling_coeffs(states: list[FlatState]) -> None:
    """σ_k = mean_j(ρ_j)/ρ_k, ρ_k = ‖m_k‖/√numel_k, over every tensor of these buckets, into
    their ``scaling_coeff`` scalars."""
    for state, sigma in zip(states, scaling_coeffs(states), strict=True):
        state.scalars["scaling_coeff"].copy_(sigma)


def exchange_scaled_(
    compress: Callable[..., torch.Tensor],
    state: FlatState,
    m: torch.Tensor,
    sigma: torch.Tensor,
    errors: dict[str, torch.Tensor] | None = None,
) -> None:
    """Steps 4–5: m ← C(m·σ)/σ in place, one ``compress(state, m, errors)`` call for the whole
    bucket (with this rank's error buffers, or staged ones: ``errors``)."""
    scale_tensors_(state.bucket, m, sigma)
    compress(state, m, errors)
    scale_tensors_(state.bucket, m, sigma, divide=True)


def early_sigma(
    states: list[FlatState], state: FlatState, step: int, freeze_step: float, before_step: bool
) -> torch.Tensor:
    """The σ an exchange of step ``step`` started before ``step()`` scales by: the frozen one;
    at the first compression step (``freeze_step`` + 1 after the bucket joined), while
    ``before_step`` (``step()`` has not frozen it yet), the σ ``step()`` will freeze, computed
    from the committed momenta of every bucket of ``states`` freezing then (nothing is committed
    here). Inside ``step()`` (a bucket completed there) σ is already frozen."""
    if before_step and step - state.bucket.first_step == freeze_step + 1:
        freezing = [s for s in states if step - s.bucket.first_step == freeze_step + 1]
        return scaling_coeffs(freezing)[freezing.index(state)]
    return state.scalars["scaling_coeff"]


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
