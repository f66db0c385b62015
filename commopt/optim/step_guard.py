r"""A bound on the per-element Adam step, for elements whose variance is tiny but not zero.

After a 1-bit exchange every element receives ±scale, the scale of its whole bucket: the code has
no zero and no per-element magnitude. An element whose variance v is tiny (a byte seen once on a
variance step, a nearly dead ReLU unit) then steps by lr·scale/(√v + ε), which can be 10⁴ times
any step exact Adam would take (docs/algorithms/zero_one_adam.md measured it; the 0/1 Adam demo
went to NaN at β2 = 0.999 this way). The zero-variance guard (SPEC §8: elements with v == 0 do not
move) does not reach these elements.

The guard here bounds the step by the largest step exact Adam can take at all. With uncorrected
moments m_t = (1−β1)·Σ_k β1^k g_{t−k} and v_t = (1−β2)·Σ_k β2^k g²_{t−k}, Cauchy–Schwarz gives,
for every gradient sequence and every t (the proof is in docs/algorithms/step_guard.md),

    |m_t| / √v_t  ≤  B(β1, β2) = (1 − β1) / √((1 − β2)·(1 − β1²/β2))      (β1² < β2)

so u = m/(√v + ε) is clamped to [−B, B] elementwise. Wherever exact Adam could have produced the
step, the guard changes nothing, bit for bit; it only cuts steps that no Adam trajectory could
take, so it needs no tuning and is independent of the gradients' scale (unlike a larger ε). With
bias correction (1-bit Adam) the bound is the supremum over t of the same estimate times
√(1 − β2^t)/(1 − β1^t).

Which elements are clamped (``step_guard=`` on the optimizers):

- ``"tiny"`` (the default): only elements whose v is below ``TINY_VARIANCE`` (1 %) of the mean v of
  their own parameter tensor. Those are the elements a 1-bit exchange can blow up (its code gives
  them the bucket's magnitude); every other element keeps its step bit for bit, so the guard
  costs nothing where v is ordinary, even when the compressed momentum exceeds B there (which it
  does at small β2: B(0.9, 0.96) = 1.26, and clamping every element cost 0.7–1.1 % on the demo).
- ``True``: every element (the first version of this guard).
- ``False``: off (the papers' step).

It is an intended difference from the papers and from DeepSpeed, which apply m/(√v + ε) as is.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch

from commopt.buckets import Segment
from commopt.choices import StepGuard
from commopt.kernels import get_kernels

if TYPE_CHECKING:
    from commopt.optim.flat_state import FlatState

__all__ = [
    "TINY_VARIANCE",
    "adam_step_bound",
    "bound_step_",
    "guarded_denominator",
    "guarded_elements",
    "step_bound",
]

TINY_VARIANCE = 1e-2
"""``"tiny"`` clamps the elements whose v < TINY_VARIANCE · mean(v) of their tensor. An element at
the threshold, with a momentum of the bucket's typical size (≈ √mean(v)), steps by ≈ 10, so the
clamp at B (7.27 at the papers' betas) can only bind below it; above it, nothing changes."""


@functools.lru_cache(maxsize=64)  # a pure function of the betas; the scan takes ~25 ms
def adam_step_bound(beta1: float, beta2: float, bias_correction: bool = False) -> float:
    r"""B: the largest |m/√v| (|m̂/√v̂| with ``bias_correction``) exact Adam can reach.

    Kept per (β1, β2, bias_correction): with bias correction it scans t until β2^t < 1e-12,
    ≈ 27,600 terms (24 ms) at β2 = 0.999, which every compression step would otherwise pay per
    guarded segment.

    ``math.inf`` when β1² ≥ β2: then no such bound exists (a gradient growing like (β1/β2)^−k
    makes the ratio grow without limit) and the guard is off.

    Args:
        beta1, beta2: the optimizer's betas, in [0, 1).
        bias_correction: whether the step uses m̂ = m/(1−β1^t) and v̂ = v/(1−β2^t).
    """
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"Invalid betas: ({beta1}, {beta2}) (each must be in [0, 1))")
    if beta2 == 0.0 or beta1 * beta1 >= beta2:
        return math.inf if beta1 > 0.0 or beta2 > 0.0 else 1.0
    q = beta1 * beta1 / beta2
    limit = (1.0 - beta1) / math.sqrt((1.0 - beta2) * (1.0 - q))
    if not bias_correction:
        return limit
    # B_t = (1−β1)/√(1−β2)·√((1 − q^t)/(1 − q))·√(1 − β2^t)/(1 − β1^t); every factor but the
    # last two tends to its limit, and they tend to 1: scan t until both have settled.
    best, t = 0.0, 1
    while True:
        b_t = (
            (1.0 - beta1)
            / math.sqrt(1.0 - beta2)
            * math.sqrt((1.0 - q**t) / (1.0 - q))
            * math.sqrt(1.0 - beta2**t)
            / (1.0 - beta1**t)
        )
        best = max(best, b_t)
        if beta2**t < 1e-12 and beta1**t < 1e-12:
            return max(best, limit)
        t += 1


def bound_step_(
    update: torch.Tensor, bound: float, where: torch.Tensor | slice | None = None
) -> torch.Tensor:
    """update ← clamp(update, −bound, bound) in place; returns ``update``.

    Elements inside the bound keep every bit; ``bound = inf`` changes nothing (and costs no
    pass). NaN stays NaN (the optimizers' finiteness checks see it). ``where`` (1-D indices into
    ``update``): clamp only those elements, leave the others untouched.
    """
    if not bound > 0.0:
        raise ValueError(f"Invalid bound: {bound} (must be > 0)")
    if math.isinf(bound):
        return update
    # the bound as the largest value of update's dtype not above it (fp32 rounds 7.2703 up)
    b = torch.tensor(bound, dtype=update.dtype)
    if float(b) > bound:
        b = torch.nextafter(b, torch.zeros_like(b))
    if where is None or isinstance(where, slice):
        return update.clamp_(-float(b), float(b))
    update[where] = update[where].clamp_(-float(b), float(b))
    return update


def guarded_denominator(
    out: torch.Tensor,
    m: torch.Tensor,
    d: torch.Tensor,
    bound: float,
    where: torch.Tensor | slice,
    *,
    copy: bool = True,
) -> torch.Tensor:
    """out = d, except out[where] = max(d, |m|/bound) there: then |m/out| ≤ bound (to within an
    ulp) where the guard acts, and ``addcdiv(m, out)`` gives every other element exactly the bits
    of ``addcdiv(m, d)`` (clamping m/d and dividing by 1 would round differently). Returns out.

    ``copy=False``: out already equals d outside ``where`` (a kept buffer,
    :meth:`~commopt.optim.flat_state.FlatState.guard_denominator_base`); only ``where`` is
    written, which saves a pass over the bucket."""
    if copy:
        out.copy_(d)
    if math.isinf(bound):
        return out
    if not bound > 0.0:
        raise ValueError(f"Invalid bound: {bound} (must be > 0)")
    if isinstance(where, slice):
        out[where] = torch.maximum(d[where], m[where].abs().div_(bound))
    else:  # a gather and a scatter, fused on CPU (commopt.kernels)
        get_kernels(out.device).guard_denominator_(out, m, d, bound, where)
    return out


def step_bound(mode: StepGuard, betas: tuple[float, float], bias_correction: bool = False) -> float:
    """B(β1, β2) (:func:`adam_step_bound`) when the guard is on (``mode`` not False), else
    ``math.inf``."""
    if not mode:
        return math.inf
    return adam_step_bound(*betas, bias_correction)


def guarded_elements(
    mode: StepGuard, state: FlatState, seg: Segment
) -> torch.Tensor | slice | None:
    """Which elements of segment ``seg`` of ``state`` the guard clamps: ``None`` (none: the
    unguarded path, bit-identical to ``step_guard=False``), ``slice(None)`` (all, with
    ``step_guard=True``) or their indices relative to the segment (``"tiny"``: v below
    :data:`TINY_VARIANCE` of its tensor's mean)."""
    if mode is False:
        return None
    if mode is True:
        return slice(None)
    return state.tiny_variance_in(TINY_VARIANCE, seg.start, seg.stop)
