"""The Adam arithmetic the three optimizers share, as free functions on tensors: the moments,
the update and the bound its guard keeps it to, and fp32 master weights.

No optimizer, bucket or backend in sight: each function is one line of the papers, applied to
flat slices or lists of views, in place, with torch.optim.Adam's exact operations (``lerp`` for
the momentum, one ``addcdiv`` for the update) so that results match it bit for bit.

- **Moments**: :func:`update_moments_`, :func:`momentum_from_grads_`.
- **The update**: :func:`adam_update_`, and :func:`guarded_adam_update_`, the one guarded update
  of 1-bit and 0/1 Adam (the step guard, below). The denominator
  √v̂ + ε is :meth:`FlatState.denominator <commopt.optim.flat_state.FlatState.denominator>`,
  kept while v does not change.
- **Masks**: what a compressed exchange hands back is masked: the user's ``exp_avg_mask``
  (:func:`apply_exp_avg_mask_`), and commopt's guard against elements whose variance is exactly
  zero (:class:`ZeroVarianceGuard`; an intended difference from SPEC §2–§4 and DeepSpeed, SPEC
  §8).
- **0/1 Adam's bias correction** v̂ = v/(1 − β2^k), k the variance updates v has had. 0/1 Adam
  (SPEC §4, the paper's reference implementation, DeepSpeed) uses v as it is. v starts at 0 and
  after k variance updates is (1 − β2^k) of its level, so a variance frozen early (T_v of a few
  hundred steps at β2 = 0.999) is a few per cent of its level and every step is 1/√(1 − β2^k)
  too large for the rest of the run. commopt's ``ZeroOneAdam(bias_correction=True)`` divides v
  by 1 − β2^k instead, an intended difference (docs/algorithms/zero_one_adam.md). k counts
  *variance updates*, not steps: variance steps thin out (I_v doubles after every
  ``var_update_scaler`` of them), so k is far below t. It is a function of the shared schedule
  alone, hence identical on every rank with no message, and needs no state of its own: I_v =
  2^j after j·S variance steps (S = ``var_update_scaler``), so the updates so far are j·S +
  ``var_counter``. A param group added later counts from the update count when it joined.

**The step guard**: a bound on the per-element Adam step, for elements whose variance is tiny
but not zero.

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

Mixed precision: fp32 master weights for bf16/fp16 parameters, and GradScaler's unscale.

The algorithms always run in fp32. For a bf16/fp16 parameter the fp32 value it is computed
from is a flat ``"master"`` buffer of its bucket (saved in ``state_dict()`` like any state, so a
resumed run continues from the unrounded weights); the parameter itself is its rounding.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from commopt.buckets import Bucket, Segment
from commopt.choices import StepGuard
from commopt.kernels import get_kernels
from commopt.notices import warn_at_caller
from commopt.optim.flat_state import FlatState
from commopt.optim.freeze import VarianceLevel, variance_level

if TYPE_CHECKING:
    from commopt.buckets import Segment
    from commopt.optim.flat_state import FlatState

__all__ = [
    "IDLE_STEPS",
    "TINY_VARIANCE",
    "ZeroVarianceGuard",
    "adam_step_bound",
    "adam_update_",
    "apply_exp_avg_mask_",
    "bound_step_",
    "guard_limits",
    "guarded_adam_update_",
    "guarded_denominator",
    "guarded_elements",
    "master_weights",
    "momentum_from_grads_",
    "momentum_step_size",
    "momentum_step_sizes",
    "refuse_complex_and_float64",
    "step_bound",
    "unscale_grads_",
    "update_moments_",
    "variance_bias_sqrt",
    "variance_denominator",
    "variance_level_of",
    "variance_steps_through",
    "variance_updates",
]

#: ``state[p]`` keys of the steps a parameter sat out (no gradient on any rank), all of them
#: and those that would have updated v; absent until it sits one out. m̂ and v̂ of a parameter
#: count its own updates, as torch's ``state[p]["step"]`` does (FlatState.count_idle).
IDLE_STEPS = ("idle_steps", "idle_variance_steps")


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
        beta1: the optimizer's β1, in [0, 1).
        beta2: the optimizer's β2, in [0, 1).
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


def update_moments_(
    m: torch.Tensor, v: torch.Tensor | None, g: torch.Tensor, beta1: float, beta2: float
) -> None:
    r"""m ← β1·m + (1−β1)·g (as ``lerp``);  v ← β2·v + (1−β2)·g² (skipped when v is None)."""
    m.lerp_(g, 1 - beta1)
    if v is not None:
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)


def momentum_from_grads_(
    m_views: Sequence[torch.Tensor], params: Sequence[torch.Tensor], beta1: float
) -> None:
    r"""m ← β1·m + (1−β1)·g with each parameter's own gradient, read where it is.

    A parameter without a gradient contributes g = 0 (m ← β1·m). bf16/fp16 gradients are
    widened to the state's fp32 (exactly) because ``lerp`` wants one dtype.
    """
    views, grads, without = [], [], []
    for view, p in zip(m_views, params, strict=True):
        if p.grad is None:
            without.append(view)
        else:
            views.append(view)
            grads.append(p.grad.to(view.dtype))
    if views:
        torch._foreach_lerp_(views, grads, 1 - beta1)
    if without:
        torch._foreach_mul_(without, beta1)


def adam_update_(
    params: Sequence[torch.Tensor],
    m_views: Sequence[torch.Tensor],
    d_views: Sequence[torch.Tensor],
    lr: float,
    weight_decay: float,
    step_size: float,
) -> None:
    r"""p ← p·(1 − η·λ) − step_size·m/d: decoupled decay, then one ``addcdiv`` (torch's Adam).

    step_size is η/(1−β1ᵗ) with bias correction, η without.
    """
    params = list(params)
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_addcdiv_(params, list(m_views), list(d_views), value=-step_size)


def guarded_adam_update_(
    state: FlatState,
    segments: Iterable[tuple[Segment, dict[str, Any]]],
    m: torch.Tensor,
    d: torch.Tensor,
    step_sizes: Sequence[float],
    limits: Sequence[float | None],
    step_guard: StepGuard,
    target: torch.Tensor | None = None,
) -> None:
    r"""p ← p·(1 − η·λ) − step_size·m/d′ for each segment and its group, where d′ = d except
    on the elements the step guard names (:func:`~commopt.optim.adam.guarded_elements`):
    d′ = max(d, |m|/limit) there, so |m/d′| ≤ limit. ``limits[k]`` None: segment k is not
    guarded (d′ = d). ``target``: a flat buffer laid out like the bucket takes the update in
    place of the parameters (0/1 Adam's staged sync). The one guarded Adam update of 1-bit
    and 0/1 Adam; every unguarded element has the bits of ``addcdiv(m, d)``."""
    d_guard = None  # d, with the guarded elements rewritten (the whole bucket, kept)
    for (seg, group), step_size, limit in zip(segments, step_sizes, limits, strict=True):
        guarded = limit is not None and not math.isinf(limit)
        where = guarded_elements(step_guard, state, seg) if guarded else None
        d_seg = d
        if where is not None:
            if d_guard is None:
                d_guard = state.guard_denominator_base(d)
            d_seg = d_guard
            sl = seg.slice
            guarded_denominator(d_seg[sl], m[sl], d[sl], limit, where, copy=False)
        params = seg.params if target is None else seg.views(target)
        wd = group["weight_decay"]
        adam_update_(params, seg.views(m), seg.views(d_seg), group["lr"], wd, step_size)


def apply_exp_avg_mask_(
    flat: torch.Tensor, state: FlatState, param_groups: Sequence[dict[str, Any]]
) -> None:
    """flat ← flat ⊙ exp_avg_mask, group by group (the mask broadcasts to each parameter)."""
    for seg in state.bucket.segments:
        mask = param_groups[seg.group].get("exp_avg_mask")
        if mask is not None:
            for view in seg.views(flat):
                view.mul_(mask.to(device=view.device, dtype=view.dtype))


class ZeroVarianceGuard:
    """flat ← 0 wherever the variance v is exactly 0.

    An element whose v is 0 had a zero averaged gradient on every full-precision step so far:
    an embedding row never looked up, a dead ReLU unit. The 1-bit code has no zero, so the
    exchange hands it ±scale all the same, and its step m/(√v + ε) would be divided by ε alone,
    ~1/ε times too large (the loss of a byte-level LM went to NaN this way). Such elements are
    treated as masked: their momentum stays 0 and they do not move while v is 0. v is identical
    on every rank, so replicas stay identical. Warns once (on the rank that asks to).
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.warned = False

    def apply_(self, state: FlatState, flat: torch.Tensor, warn: bool) -> None:
        """flat ← 0 where v = 0 (warns once if ``warn``)."""
        where = state.zero_variance()
        if where is None:
            return
        if warn and not self.warned:
            self.warned = True
            warn_at_caller(
                f"{self.owner}: {where.numel()} of {flat.numel()} elements have zero variance "
                "(a zero averaged gradient on every full-precision step so far); they do not "
                "move while it is zero, as if exp_avg_mask were 0 there, because their step "
                "m/(sqrt(v) + eps) would be divided by eps alone"
            )
        flat.index_fill_(0, where, 0.0)


def variance_updates(var_interval: int, var_counter: int, scaler: int) -> int:
    """Variance updates since step 1, from 0/1 Adam's schedule state: I_v doubled once per
    ``scaler`` updates, so it is 2^j after j·scaler of them, plus ``var_counter`` since."""
    j = var_interval.bit_length() - 1
    if var_interval != 1 << j:
        raise ValueError(f"var_interval must be a power of 2, got {var_interval}")
    return j * scaler + var_counter


def variance_steps_through(step: int, scaler: int) -> int:
    """Variance steps among steps 1..``step`` of phase A (``step`` ≤ T_v), replaying the
    schedule: t is one when t ≡ 0 (mod I_v), I_v doubling after every ``scaler`` of them."""
    interval, counter, count = 1, 0, 0
    t = interval
    while t <= step:  # only the variance steps themselves: t jumps by I_v
        count += 1
        counter += 1
        if counter == scaler:
            counter, interval = 0, 2 * interval
        t = (t // interval + 1) * interval  # the next multiple of the (new) interval
    return count


def variance_bias_sqrt(beta2: float, k: int, correct: bool) -> float:
    r"""b = √(1 − β2^k), so that √v̂ = √v / b; 1 without correction, and for k = 0 (no update
    yet: v is 0 there, the zero-variance mask keeps those elements still, nothing to scale)."""
    if not correct or k <= 0:
        return 1.0
    return math.sqrt(1.0 - beta2**k)


def momentum_step_size(lr: float, beta1: float, t: int, correct: bool) -> float:
    r"""η/(1 − β1^t): the step size that applies m̂ = m/(1 − β1^t) (m is updated every step, so
    t counts steps, from the group's first); η itself without correction."""
    if not correct or t <= 0:
        return lr
    return lr / (1.0 - beta1**t)


def variance_denominator(
    state: FlatState, groups: Sequence[dict[str, Any]], k: int
) -> torch.Tensor:
    """0/1 Adam's √v̂ + ε, read-only, kept while v does not change: v̂ = v/(1 − β2^k′) per
    group with ``bias_correction`` (k′ = k − the group's ``variance_offset`` − the variance
    steps the parameter sat out: its own variance updates), else v as it is (SPEC §4)."""
    runs = state.idle_runs(groups, IDLE_STEPS)
    bias_sqrt, eps = [], []
    for _, g, (_, idle) in runs:
        k_own = k - g["variance_offset"] - idle
        bias_sqrt.append(variance_bias_sqrt(g["betas"][1], k_own, g["bias_correction"]))
        eps.append(g["eps"])
    return state.denominator(bias_sqrt, eps, [seg for seg, _, _ in runs])


def momentum_step_sizes(groups: Sequence[dict[str, Any]], step: int) -> list[float]:
    """η/(1 − β1^t) per param group with ``bias_correction`` (t: steps since the group
    joined, ``first_step``), else η."""
    return [
        momentum_step_size(g["lr"], g["betas"][0], step - g["first_step"], g["bias_correction"])
        for g in groups
    ]


def variance_level_of(
    states: Iterable[FlatState],
    segments: Callable[[FlatState], Iterable[tuple[Segment, dict[str, Any]]]],
    k: int,
    corrected: Callable[[dict[str, Any]], bool] = lambda group: True,
) -> VarianceLevel:
    """What the automatic freeze observes: Σ ln mean(√v̂) over the tensors of these buckets,
    v̂ = v/(1 − β2^k) in the groups ``corrected`` names, v elsewhere
    (:func:`~commopt.optim.freeze.variance_level`)."""
    level = VarianceLevel()
    for state in states:
        v = state.flat["exp_avg_sq"]
        if state.bucket.sharding is not None:
            level += _sharded_variance_level(state, list(segments(state)), k, corrected)
            continue
        for seg, group in segments(state):
            bias = 1 - group["betas"][1] ** k if corrected(group) else 1.0
            level += variance_level(seg.views(v), bias)
    return level


def _sharded_variance_level(
    state: FlatState,
    segments: list[tuple[Segment, dict[str, Any]]],
    k: int,
    corrected: Callable[[dict[str, Any]], bool],
) -> VarianceLevel:
    """:func:`variance_level_of` for a bucket of shards: each tensor's Σ √v̂ over its shards
    (float64, added over the shard group), over its whole count, so that every rank of the
    shard group observes the same level and freezes at the same step."""
    v, bucket = state.flat["exp_avg_sq"], state.bucket
    sums, numels, index = [], [], 0
    for seg, group in segments:
        bias = 1 - group["betas"][1] ** k if corrected(group) else 1.0
        for view in seg.views(v):
            sums.append(view.double().div(bias).sqrt_().sum())
            numels.append(bucket.tensor_numels[index])
            index += 1
    if not sums:
        return VarianceLevel()
    total = torch.stack(sums)
    bucket.sharding.sum_over_shards_(total)  # type: ignore[union-attr]
    level, count = 0.0, 0
    for s, n in zip(total.tolist(), numels, strict=True):
        if n and s > 0:
            level += math.log(s / n)
            count += 1
    return VarianceLevel(level, count)


def guard_limits(
    segments: Iterable[tuple[Segment, dict[str, Any]]],
    step_sizes: Sequence[float],
    step_guard: StepGuard,
) -> list[float]:
    """0/1 Adam's step-guard limit on |m/d| per segment, so that |m̂/d| ≤ B where the step
    applies m̂ = m·step_size/η: B·(η/step_size), B itself where step_size = η (bit for bit)."""
    limits = []
    for (_, group), step_size in zip(segments, step_sizes, strict=True):
        bound = step_bound(step_guard, group["betas"], group["bias_correction"])
        if step_size != group["lr"]:
            bound *= group["lr"] / step_size
        limits.append(bound)
    return limits


@contextlib.contextmanager
def master_weights(
    states: Iterable[FlatState], param_state: MutableMapping[torch.Tensor, dict[str, Any]]
) -> Iterator[None]:
    """Inside: in every bucket, each non-fp32 parameter is replaced by its fp32 master copy (a
    view of the bucket's ``"master"`` buffer, its ``.grad`` the gradient widened to fp32,
    exactly); on exit the parameter is rounded from it. The master copy starts as the
    parameter's value.

    The parameter itself is never touched inside: swapping its ``.data`` to another dtype would
    drop the gradient-accumulator hooks DDP registered on it (and DDP would wait at the next
    step for gradients that never come)."""
    swapped: list[tuple[Bucket, tuple[list[torch.Tensor], list[Segment]]]] = []
    rounding: list[tuple[torch.Tensor, torch.Tensor]] = []
    for state in states:
        bucket = state.bucket
        if all(p.dtype == torch.float32 for p in bucket.params):
            continue
        fresh = {id(p) for p in bucket.params if "master" not in param_state[p]}
        master = state.buffer("master")
        proxies: dict[int, torch.Tensor] = {}
        for p, view in zip(bucket.params, bucket.views(master), strict=True):
            if p.dtype == torch.float32:
                param_state[p].pop("master", None)  # fp32 parameters are their own master
                continue
            if id(p) in fresh:
                view.copy_(p)
            if p.grad is not None:
                view.grad = p.grad.to(torch.float32)
            proxies[id(p)] = view
            rounding.append((p, view))
        swapped.append((bucket, bucket.stand_in(proxies)))
    try:
        yield
    finally:
        for bucket, restore in swapped:
            bucket.params, bucket.segments = restore
        with torch.no_grad():
            for p, view in rounding:
                p.copy_(view)
                view.grad = None


def unscale_grads_(params: Iterable[torch.Tensor], scale: torch.Tensor | float) -> None:
    """g ← g / scale in place, as ``GradScaler.unscale_`` (the reciprocal in double, then fp32)."""
    inv = scale.double().reciprocal().float() if torch.is_tensor(scale) else 1.0 / scale
    for p in params:
        if p.grad is not None:
            p.grad.mul_(inv.to(p.grad.device) if torch.is_tensor(inv) else inv)


def refuse_complex_and_float64(name: str, params: Iterable[torch.Tensor]) -> None:
    """The parameters whose values fp32 state and the 1-bit code cannot hold, refused.

    Raises:
        TypeError: a complex parameter (the 1-bit code has no phase), or a float64 one (fp32
            state would round it, silently).
    """
    for p in params:
        if p.is_complex():
            raise TypeError(
                f"{name} does not support complex parameters (got {p.dtype}): "
                "the 1-bit code has no phase; optimize torch.view_as_real(p) instead"
            )
        if p.dtype == torch.float64:
            raise TypeError(
                f"{name} keeps fp32 state and communicates fp32, so a float64 "
                "parameter would silently lose precision; convert the model with "
                ".float() (or use a torch.optim optimizer alone for float64)"
            )
