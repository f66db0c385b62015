r"""1-bit LAMB's scaling coefficients σ and the σ-scaled exchange m ← C(m·σ)/σ (SPEC §3 2, 4–5).

At the first compression step, before that step's update, σ_k = mean_j(ρ_j)/ρ_k with
ρ_k = ‖m_k‖/√numel_k is frozen from the committed momenta of every bucket freezing then
(σ_k = 1 where ρ_k = 0; a tensor with no elements takes no part in the mean). From then on
every compressed exchange of the momentum is scaled by σ around it, so that tensors of very
different magnitudes share one bucket's scale fairly. The exchange runs in ``step()`` or,
staged, during backward (DDP hook, ``overlap=True``: :func:`early_sigma`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from commopt.optim.flat_state import FlatState
from commopt.optim.per_tensor import scale_tensors_, tensor_norms

if TYPE_CHECKING:
    from commopt.optim.base import CompressedOptimizer

__all__ = ["early_sigma", "exchange_scaled_", "freeze_scaling_coeffs", "scaling_coeffs"]


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
    mean = torch.cat(nonempty).sum() / count if count else torch.tensor(0.0)
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


def early_sigma(opt: CompressedOptimizer, state: FlatState, step: int) -> torch.Tensor:
    """The σ an exchange of step ``step`` started before ``step()`` scales by: the frozen one;
    at the first compression step, before ``step()`` has frozen it, the σ ``step()`` will
    freeze, computed from the committed momenta of every bucket freezing then (nothing is
    committed here). Inside ``step()`` (a bucket completed there) σ is already frozen."""
    freeze_step = opt.frozen_after()
    before_step = opt.global_state["step"] < step
    if before_step and step - opt.first_step(state) == freeze_step + 1:
        freezing = [s for s in opt.flat_states if step - opt.first_step(s) == freeze_step + 1]
        return scaling_coeffs(freezing)[freezing.index(state)]
    return state.scalars["scaling_coeff"]
