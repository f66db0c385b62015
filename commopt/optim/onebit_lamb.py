"""1-bit LAMB: LAMB for a warmup, then one fused 1-bit momentum exchange per step.

Below the optimizer, its per-tensor quantities: norms, the scaling coefficients σ, the trust
ratios.

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

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.optim.optimizer import ParamsT

from commopt.buckets import Bucket, Segment
from commopt.choices import TrustRatio
from commopt.comm import Backend
from commopt.compressed import NonFiniteError
from commopt.optim._early import Kind, WarmupThenMomentum
from commopt.optim.adam import (
    bound_step_,
    guarded_elements,
    step_bound,
    update_moments_,
    variance_level_of,
)
from commopt.optim.base import BucketOps, CompressedOptimizer, StepContext
from commopt.optim.config import (
    DEFAULT_FREEZE_STEP,
    CommKeywords,
    OnebitLambConfig,
    check_adam_arguments,
    comm_keywords,
    configured_by,
)
from commopt.optim.flat_state import FlatState
from commopt.optim.freeze import AutoFreezeSettings, auto_settings

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "OnebitLamb",
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


@configured_by(OnebitLambConfig)
class OnebitLamb(CompressedOptimizer):
    r"""1-bit LAMB (Li et al., 2022): LAMB for a warmup, then 1-bit compressed momentum.

    β1, β2 are ``betas``; η is ``lr``; λ is ``weight_decay``; T_w is ``freeze_step``; k indexes
    parameter tensors; g is this rank's gradient and ḡ its average over the n ranks. No bias
    correction, as in the paper's reference implementation.

    **Warmup** (t = 1 … T_w), LAMB on the averaged gradient with a frozen-ratio EMA c̄ (c̄ = 0
    initially):

    .. math::
        m_k ← β_1 m_k + (1-β_1)\,ḡ_k,\qquad v_k ← β_2 v_k + (1-β_2)\,ḡ_k^2,\qquad
        u_k = \frac{m_k}{\sqrt{v_k} + ε} + λ p_k \\
        c_k = \mathrm{clip}\big(‖p_k‖/‖u_k‖,\ \text{min\_coeff},\ \text{max\_coeff}\big)
        \ (1 \text{ if a norm is } 0),\qquad
        \bar c_k ← β_c \bar c_k + (1-β_c) c_k \ (\text{if } c_k ≠ 1),\qquad
        p_k ← p_k - η\,c_k\,u_k

    and at t = T_w the fresh variance starts as v_f = v.

    **Compression** (t > T_w), v frozen. At t = T_w + 1 only, per-tensor scaling coefficients
    σ_k = mean_j(ρ_j)/ρ_k with ρ_k = ‖m_k‖/√numel_k (σ_k = 1 where ρ_k = 0) are frozen from the
    momentum before that step's update. Then, with C the compressed allreduce of SPEC §1 run
    **once** over the whole model's momentum:

    .. math::
        m^{prev} = m,\qquad m ← \mathrm{C}\big((β_1 m + (1-β_1) g)\,σ\big) / σ \odot \text{mask} \\
        \hat g = \frac{m - β_1 m^{prev}}{1-β_1},\qquad v_f ← β_2 v_f + (1-β_2)\,\hat g^2 \\
        f_k = \max_i \frac{\sqrt{v_{k,i}} + ε}{\sqrt{v_{f,k,i}} + ε},\qquad
        u^0_k = \frac{m_k}{\sqrt{v_k} + ε},\qquad u_k = u^0_k + λ p_k \\
        f_k ← r_k f_k + (1 - r_k),\quad r_k = \min(1, ‖u^0_k‖/‖u_k‖)\ \ (\text{only if } λ > 0) \\
        f_k ← \mathrm{clip}\big(\mathrm{clip}(f_k, \text{factor\_min}, \text{factor\_max}),\
              f^{last}_k (1-τ),\ f^{last}_k (1+τ)\big),\qquad f^{last}_k ← f_k \\
        p_k ← p_k - η\,\bar c_k f_k\,u_k

    where τ is ``factor_threshold`` and f^last starts at 1. mask = ``exp_avg_mask`` ⊙ [v ≠ 0]:
    elements whose frozen v is 0 keep m = 0 (commopt's guard against steps divided by ε alone,
    see ``OnebitAdam``; not in SPEC §3).

    Args:
        params: parameters or param groups; a group may carry ``exp_avg_mask``, a 0/1 tensor
            broadcastable to each of its parameters, applied to the momentum after each
            compressed exchange.
        lr: learning rate η (default 1e-3).
        betas: (β1, β2) (default (0.9, 0.999)).
        eps: ε added to the denominator (default 1e-8).
        weight_decay: decoupled weight decay λ (default 0).
        freeze_step: T_w, the number of full-precision LAMB steps (default 100000, >= 1), or
            ``"auto"`` / a :class:`commopt.AutoFreezeSettings` choosing its constants (below).
        max_coeff: upper clamp of the warmup trust ratio (default 10.0).
        min_coeff: lower clamp of the warmup trust ratio (default 0.01).
        coeff_beta: β_c, EMA factor of the frozen trust ratio c̄ (default 0.9).
        factor_max: upper clamp of the variance factor f (default 4.0).
        factor_min: lower clamp of the variance factor f (default 0.5).
        factor_threshold: τ, the most f may change relative to the previous step (default 0.1).
        backend: communication backend; ``None`` resolves as SPEC §5 (``commopt.init()``'s).
        trust_ratio: ``"max"`` (default): max(c̄_k·f_k, c_k) per tensor with c_k LAMB's own
            ratio clip(‖p_k‖/‖u_k‖, min_coeff, max_coeff) of the update u = m/(√v + ε) + λp
            that every rank already holds after the exchange (no message;
            :mod:`commopt.optim.onebit_lamb`). ``"frozen"``: c̄·f as above, SPEC §3 exactly
            (DeepSpeed's rule). ``"tracking"``: c_k alone, recomputed every compression step
            (f and v_f are not used).
        {communication_options}

    With ``overlap=True`` the warmup's full-precision average starts during backward, and in
    the compression stage the fold and the σ-scaled exchange m' ← C(m'·σ)/σ (at the first
    compression step with the σ ``step()`` is about to freeze); ``step()`` waits, commits and
    runs the rest (v_f, the factor, the trust ratio, the update), bit-identical with any
    ``trust_ratio``. It needs several buckets (``bucket_numel``) to hide anything.

    ``freeze_step="auto"`` (or an :class:`commopt.AutoFreezeSettings` with other constants)
    freezes once the bias-corrected variance level has settled
    (:class:`commopt.optim.freeze.AutoFreeze`); the trust ratio normalises each layer's update, so
    the level of the uncorrected v need not have grown to its steady value first.

    Tuning: c̄ has no bias correction, so with ``coeff_beta`` = 0.9 it reaches 1 − 0.9^T_w of
    the typical trust ratio; T_w should be at least a few dozen steps (the paper uses the same
    warmup as 1-bit Adam, 15–25 % of BERT pre-training). ``factor_threshold`` bounds how fast
    the learning-rate multiplier may drift once the variance is frozen.

    Parameters may be bf16 or fp16; the optimizer state (m, v, v_f, σ, c̄, …) is fp32.

    {schedule_and_resume}

    Differences from DeepSpeed's ``OnebitLamb``: no hidden dry-run first step; the error
    buffers are saved per rank and restored on resume at the same world size; σ, c̄, v_f and
    the last factor are all in ``state_dict``; tensors with zero elements or all-zero momentum
    at the freeze point get σ = 1 instead of inf/NaN; works on CPU and GPU and in bf16.

    References:
        Li, Awan, Tang, Rajbhandari, Zhang, He. "1-bit LAMB: Communication Efficient
        Large-Scale Large-Batch Training with LAMB's Convergence Speed." HiPC 2022,
        arXiv:2104.06069.

    Examples:
        >>> import torch, commopt
        >>> w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
        >>> opt = commopt.OnebitLamb([w], lr=0.1, freeze_step=2)
        >>> for _ in range(4):
        ...     opt.zero_grad(); (w ** 2).sum().backward(); opt.step()
        >>> bool(w.abs().max() < 2.0), len(opt.get_lamb_coeffs())
        (True, 1)
    """

    _flat_keys = ("exp_avg", "exp_avg_sq")
    _lazy_flat_keys = ("exp_avg_sq_fresh",)
    _scalar_keys: ClassVar[dict[str, float]] = {
        "lamb_coeff_freeze": 0.0,  # c̄, the frozen trust ratio (EMA over the warmup)
        "scaling_coeff": 1.0,  # σ, frozen at the first compression step
        "last_factor": 1.0,  # f^last
        "lamb_coeff": 1.0,  # the trust ratio used by the last step (get_lamb_coeffs)
    }
    _default_bucket_numel = None  # one bucket, one compressed call for the whole model

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int | str | AutoFreezeSettings = DEFAULT_FREEZE_STEP,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        backend: Backend | None = None,
        *,
        trust_ratio: TrustRatio = "max",
        **comm: Unpack[CommKeywords],
    ) -> None:
        check_adam_arguments(lr, betas, eps, weight_decay)
        comm = comm_keywords(type(self).__name__, comm)
        config = OnebitLambConfig(
            **comm,
            trust_ratio=trust_ratio,
            freeze_step=freeze_step,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            coeff_beta=coeff_beta,
            factor_max=factor_max,
            factor_min=factor_min,
            factor_threshold=factor_threshold,
        )
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, config, backend)

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios c_k used by the last step, one per parameter in param_groups order
        (a copy; empty before the first step)."""
        coeffs = [
            self.state[p]["lamb_coeff"]
            for g in self.param_groups
            for p in g["params"]
            if "lamb_coeff" in self.state[p]
        ]
        return torch.stack(coeffs).tolist() if coeffs else []

    def _step(self, ctx: StepContext) -> None:
        step, freeze_step = ctx.step, ctx.freeze.last_full_step()
        compressing, warm = [], []
        for state in ctx.states:
            t = step - self.first_step(state)  # a group added later runs its own warmup
            if t <= freeze_step:
                self._warmup_step(ctx, state, keep_fresh=t == freeze_step)
                if self.first_step(state) == 0:
                    warm.append(state)
            else:
                compressing.append((state, t == freeze_step + 1))
        if compressing:
            self._compressed_step(ctx, compressing)
        if warm and auto_settings(self.config.freeze_step) is not None and math.isinf(freeze_step):
            level = variance_level_of(warm, ctx.segments, step)
            if ctx.freeze.observe(step, level):  # frozen now: v_f starts as v
                for state in warm:
                    state.buffer("exp_avg_sq_fresh").copy_(state.flat["exp_avg_sq"])

    def _early_plan(self, ops: BucketOps) -> WarmupThenMomentum:
        # steps 3–5 on a staged m′ = β1·m + (1−β1)·g: m′ ← C(m′·σ)/σ with the σ of early_sigma;
        # without a gradient g = 0 through lerp (_exchange_momentum folds gather_grads' zeros)
        def exchange(state: FlatState, m: torch.Tensor, errors: dict, step: int) -> None:
            before_step = self.global_state["step"] < step
            sigma = early_sigma(self.flat_states, state, step, self.frozen_after(), before_step)
            exchange_scaled_(ops.exchange, state, m, sigma, errors)

        return WarmupThenMomentum(self.frozen_after, exchange, True)

    def _warmup_step(self, ctx: StepContext, state: FlatState, keep_fresh: bool) -> None:
        """LAMB on the averaged gradient; the trust ratios feed the EMA c̄."""
        cfg, bucket, scalars = self.config, state.bucket, state.scalars
        m, v = state.flat["exp_avg"], state.flat["exp_avg_sq"]
        g = ctx.averaged_grads(state)  # (a DDP hook may have averaged it already)
        p = state.gather_params(state.scratch("work"))
        u = g  # g is not needed once the moments have it
        for seg, group in self.segments(state):
            el = seg.slice
            update_moments_(m[el], v[el], g[el], *group["betas"])
            torch.sqrt(v[el], out=u[el]).add_(group["eps"])
            torch.div(m[el], u[el], out=u[el])
            if group["weight_decay"] != 0:
                u[el].add_(p[el], alpha=group["weight_decay"])
        c = lamb_ratio(bucket, p, u, cfg.min_coeff, cfg.max_coeff)
        coeff_freeze = scalars["lamb_coeff_freeze"]
        ema = coeff_freeze * cfg.coeff_beta + c * (1 - cfg.coeff_beta)
        coeff_freeze.copy_(torch.where(c != 1.0, ema, coeff_freeze))
        scalars["lamb_coeff"].copy_(c)
        self._apply_update(state, u, scalars["lamb_coeff"])
        if keep_fresh:
            state.buffer("exp_avg_sq_fresh").copy_(v)

    def _compressed_step(self, ctx: StepContext, states: list[tuple[FlatState, bool]]) -> None:
        """SPEC §3 steps 1–10. Every bucket's momentum is exchanged before any is used, so a
        non-finite momentum (raised on every rank alike) restores m and σ everywhere and the
        step is skipped with nothing changed."""
        freezing = [state for state, first in states if first]
        saved_sigma = [s.scalars["scaling_coeff"].clone() for s in freezing]
        if freezing:  # 2. at the first compression step only
            freeze_scaling_coeffs(freezing)
        done: list[tuple[FlatState, dict[str, torch.Tensor]]] = []
        touched: list[FlatState] = []
        try:
            for state, _ in states:
                touched.append(state)
                self._exchange_momentum(ctx, state, done, several=len(states) > 1)
        except NonFiniteError:
            for state, comm in done:
                for key, buf in state.comm.items():
                    buf.copy_(comm[key])
            for state in touched:
                state.flat["exp_avg"].copy_(state.scratch("work"))
            for state, sigma in zip(freezing, saved_sigma, strict=True):
                state.scalars["scaling_coeff"].copy_(sigma)
            raise
        for state, _ in states:
            self._variance_factor_update(state)

    def _exchange_momentum(
        self,
        ctx: StepContext,
        state: FlatState,
        done: list[tuple[FlatState, dict[str, torch.Tensor]]],
        several: bool,
    ) -> None:
        """Steps 1 and 3–5: m_prev = m; m ← C((β1·m + (1−β1)·g)·σ)/σ ⊙ mask (or the m' a
        DDP hook folded and exchanged during backward, :meth:`_early_plan`)."""
        m = state.flat["exp_avg"]
        state.scratch("work").copy_(m)  # 1. m_prev
        # With several buckets, an earlier bucket's error buffers must be restorable if a later
        # exchange finds non-finite values; with one, the exchange leaves them untouched itself.
        saved = {k: v.clone() for k, v in state.comm.items()} if several else {}
        if ctx.take(Kind.MOMENTUM, state) is not None:  # 3.–5. done during backward
            done.append((state, saved))
            ctx.mask(state, m)
            return
        g = state.gather_grads(state.scratch("grad"))
        for seg, group in self.segments(state):  # 3.
            update_moments_(m[seg.slice], None, g[seg.slice], group["betas"][0], 0.0)
        exchange_scaled_(ctx.exchange, state, m, state.scalars["scaling_coeff"])  # 4.–5.
        done.append((state, saved))
        ctx.mask(state, m)

    def _tracking_update(self, state: FlatState) -> None:
        """``trust_ratio="tracking"``: u = m/(√v + ε) + λp with v frozen; c_k = LAMB's clamped
        ‖p_k‖/‖u_k‖ (1 if a norm is 0); p ← p − η·c·u. m, v and p are identical on every rank
        after the exchange, so c is too, without a message."""
        cfg, bucket, scalars = self.config, state.bucket, state.scalars
        m, u = state.flat["exp_avg"], state.scratch("grad")
        eps = [group["eps"] for _, group in self.segments(state)]
        d = state.denominator([1.0] * len(bucket.segments), eps)  # √v + ε, v frozen
        p = state.gather_params(state.scratch("work"))  # m_prev is not needed here
        for seg, group in self.segments(state):
            el = seg.slice
            torch.div(m[el], d[el], out=u[el])
            where = guarded_elements(self.config.step_guard, state, seg)
            if where is not None:
                bound_step_(u[el], step_bound(self.config.step_guard, group["betas"]), where)
            if group["weight_decay"] != 0:
                u[el].add_(p[el], alpha=group["weight_decay"])
        scalars["lamb_coeff"].copy_(lamb_ratio(bucket, p, u, cfg.min_coeff, cfg.max_coeff))
        self._apply_update(state, u, scalars["lamb_coeff"])

    def _variance_factor_update(self, state: FlatState) -> None:
        """Steps 6–10: fresh variance, bounded factor, p ← p − η·c̄·f·u."""
        if self.config.trust_ratio == "tracking":
            self._tracking_update(state)
            return
        cfg, bucket, scalars = self.config, state.bucket, state.scalars
        m, m_prev = state.flat["exp_avg"], state.scratch("work")
        v_fresh = state.buffer("exp_avg_sq_fresh")
        ratio, u = m_prev, state.scratch("grad")  # reuse both buffers below
        eps = [group["eps"] for _, group in self.segments(state)]
        d_all = state.denominator([1.0] * len(bucket.segments), eps)  # √v + ε, v frozen
        for seg, group in self.segments(state):
            el = seg.slice
            beta1, beta2 = group["betas"]
            g_hat = torch.sub(m[el], m_prev[el], alpha=beta1, out=u[el]).div_(1 - beta1)  # 6.
            v_fresh[el].mul_(beta2).addcmul_(g_hat, g_hat, value=1 - beta2)
            d = d_all[el]  # 7.
            d_fresh = torch.sqrt(v_fresh[el], out=ratio[el]).add_(group["eps"])
            torch.div(d, d_fresh, out=ratio[el])
            torch.div(m[el], d, out=u[el])  # 8. u₀
            where = guarded_elements(
                self.config.step_guard, state, seg
            )  # commopt's guard (not in the paper)
            if where is not None:
                bound_step_(u[el], step_bound(self.config.step_guard, group["betas"]), where)
        factor = tensor_maxima(bucket, ratio)
        if any(group["weight_decay"] > 0 for _, group in self.segments(state)):
            u0_norm = tensor_norms(bucket, u)
            p = state.gather_params(ratio)
            for seg, group in self.segments(state):
                u[seg.slice].add_(p[seg.slice], alpha=group["weight_decay"])
            u_norm = tensor_norms(bucket, u)
            shrink = torch.where(u_norm > 0, u0_norm / torch.where(u_norm > 0, u_norm, 1.0), 1.0)
            shrink.clamp_(max=1.0)
            for group, k in tensor_ranges(self.segments(state)):
                if group["weight_decay"] > 0:
                    factor[k] = factor[k] * shrink[k] + (1 - shrink[k])
        last = scalars["last_factor"]  # 9.
        f = factor.clamp(cfg.factor_min, cfg.factor_max)
        tau = cfg.factor_threshold
        last.copy_(torch.minimum(torch.maximum(f, last * (1 - tau)), last * (1 + tau)))
        scalars["lamb_coeff"].copy_(scalars["lamb_coeff_freeze"] * last)  # 10.
        if cfg.trust_ratio == "max":  # beyond SPEC §3: at least LAMB's ratio of this u
            p = state.gather_params(ratio)
            raise_to_lamb_ratio_(scalars["lamb_coeff"], bucket, p, u, cfg.min_coeff, cfg.max_coeff)
        self._apply_update(state, u, scalars["lamb_coeff"])

    def _apply_update(self, state: FlatState, u: torch.Tensor, coeff: torch.Tensor) -> None:
        """p ← p − η·c_k·u (u is consumed)."""
        scale = torch.empty_like(coeff)
        for group, k in tensor_ranges(self.segments(state)):
            torch.mul(coeff[k], -group["lr"], out=scale[k])
        scale_tensors_(state.bucket, u, scale)
        for p, view in zip(state.bucket.params, state.bucket.views(u), strict=True):
            p.add_(view if p.dtype == view.dtype else view.to(p.dtype))


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
    """‖x_k‖₂ of every tensor k of the bucket (0 for empty tensors); of the whole tensor when
    the bucket holds shards (the shards' squared norms summed over the shard group)."""
    norms = per_tensor(torch._foreach_norm, bucket.views(flat), 0.0, flat.device)
    if bucket.sharding is None:
        return norms
    return bucket.sharding.sum_over_shards_(norms.square()).sqrt()


def tensor_maxima(bucket: Bucket, flat: torch.Tensor, empty: float = 1.0) -> torch.Tensor:
    """max x_k of every tensor k of the bucket (``empty`` for empty tensors); of the whole
    tensor when the bucket holds shards (the shards' maxima, max-reduced over the shard group,
    an empty shard contributing nothing)."""
    if bucket.sharding is None:
        return per_tensor(torch._foreach_max, bucket.views(flat), empty, flat.device)
    maxima = per_tensor(torch._foreach_max, bucket.views(flat), -math.inf, flat.device)
    bucket.sharding.max_over_shards_(maxima)
    return maxima.masked_fill_(maxima == -math.inf, empty)


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
        sizes.append(torch.tensor(bucket.tensor_numels, device=bucket.device))
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
