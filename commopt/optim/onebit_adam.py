"""1-bit Adam: Adam whose momentum travels as signs after a full-precision warmup."""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING

import torch
from torch.optim.optimizer import ParamsT

from commopt.comm import Backend
from commopt.optim._early import Kind, WarmupThenMomentum
from commopt.optim.adam import (
    IDLE_STEPS,
    guarded_adam_update_,
    momentum_from_grads_,
    momentum_step_size,
    step_bound,
    update_moments_,
    variance_bias_sqrt,
    variance_level_of,
)
from commopt.optim.base import BucketOps, CompressedOptimizer, StepContext
from commopt.optim.config import (
    DEFAULT_FREEZE_STEP,
    CommKeywords,
    OnebitAdamConfig,
    check_adam_arguments,
    comm_keywords,
    configured_by,
)
from commopt.optim.flat_state import FlatState
from commopt.optim.freeze import AutoFreezeSettings, auto_settings

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["OnebitAdam"]


@configured_by(OnebitAdamConfig)
class OnebitAdam(CompressedOptimizer):
    r"""1-bit Adam (Tang et al., 2021): Adam for a warmup, then 1-bit compressed momentum.

    β1, β2 are ``betas``; η is ``lr``; λ is ``weight_decay``; T_w is ``freeze_step``; g is this
    rank's gradient and ḡ its average over the n ranks.

    **Warmup** (t = 1 … T_w), exact Adam on the averaged gradient, decoupled weight decay:

    .. math::
        m_t = β_1 m_{t-1} + (1-β_1)\,ḡ_t,\qquad v_t = β_2 v_{t-1} + (1-β_2)\,ḡ_t^2 \\
        p_t = p_{t-1} - η\Big(\frac{m_t/(1-β_1^t)}{\sqrt{v_t/(1-β_2^t)} + ε} + λ\,p_{t-1}\Big)

    **Compression** (t > T_w): v is frozen at v_{T_w}; each rank folds its *local* gradient into
    the momentum and the momentum itself is averaged by the error-compensated 1-bit allreduce:

    .. math::
        m_t = \mathrm{C}\big(β_1 m_{t-1} + (1-β_1)\,g_t\big) \odot \text{mask} \\
        p_t = p_{t-1} - η\Big(\frac{m_t/(1-β_1^t)}{\sqrt{v_{T_w}/(1-β_2^{T_w})} + ε}
              + λ\,p_{t-1}\Big)

    Without bias correction the factors (1−β^t) are 1. At n = 1 and λ = 0 the warmup is exactly
    ``torch.optim.Adam``.

    mask = ``exp_avg_mask`` ⊙ [v ≠ 0]. The second factor is commopt's guard, not in SPEC §2 or
    DeepSpeed: the 1-bit code has no zero, so an element with v = 0 (zero gradient all warmup:
    unused embedding rows, dead units) would otherwise get ±scale and a step divided by ε alone.

    Args:
        params: parameters or param groups; a group may carry ``exp_avg_mask``, a 0/1 tensor
            broadcastable to each of its parameters, applied to the momentum after each
            compressed exchange (e.g. to keep unused embedding rows at zero).
        lr: learning rate η (default 1e-3).
        betas: (β1, β2) (default (0.9, 0.999)).
        eps: ε added to the denominator (default 1e-8).
        weight_decay: decoupled weight decay λ (default 0).
        freeze_step: T_w, the number of full-precision warmup steps (default 100000, >= 1), or
            ``"auto"``: freeze once the variance has settled
            (:class:`commopt.optim.freeze.AutoFreeze`, docs/algorithms/auto_freeze.md); the step
            chosen is ``global_state["auto_freeze_step"]``, logged once, saved and restored with
            the state. A :class:`commopt.AutoFreezeSettings` chooses the rule's constants
            (min_step, max_step, fraction, threshold); ``"auto"`` is ``AutoFreezeSettings()``.
        bias_correction: divide by 1−β^t as Adam does (default True).
        backend: communication backend; ``None`` resolves as SPEC §5 (``commopt.init()``'s).
        {communication_options}

    With ``overlap=True`` the warmup's full-precision average, and in the compression stage the
    momentum's fold and compressed exchange, start during backward (docs/overlap.md).

    Tuning ``freeze_step``: the variance must have settled before it is frozen, because every
    later step divides by it. Too early and the frozen √v is too small or too noisy, and
    training diverges or slows; too late and you pay full-precision communication for longer
    than needed (whole-run savings are capped at 1/(w + (1−w)/32) for a warmup fraction w).
    The paper uses 15–25 % of training for BERT; a practical test is to watch
    ‖v_t − v_{t−k}‖/‖v_t‖ during warmup and freeze once it changes by a few percent per
    thousand steps; ``freeze_step="auto"`` applies such a test (the log of each layer's mean
    √v̂, averaged over layers, moved by at most 5 % over the last half of the steps so far)
    without any message between ranks; ``freeze_step=commopt.AutoFreezeSettings(threshold=0.03,
    max_step=5000)`` makes it stricter and bounds the warmup.

    {schedule_and_resume}

    Differences from DeepSpeed's ``OnebitAdam``: ``bias_correction`` is honoured (DeepSpeed
    ignores it); there is no hidden dry-run first step, the first batch trains; the error
    buffers are saved per rank and restored on resume at the same world size (DeepSpeed resets
    them); works without any training engine, on CPU and GPU.

    References:
        Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang, He. "1-bit Adam: Communication
        Efficient Large-Scale Training with Adam's Convergence Speed." ICML 2021,
        arXiv:2102.02888.

    Examples:
        >>> import torch, commopt
        >>> w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
        >>> opt = commopt.OnebitAdam([w], lr=0.1, freeze_step=2)
        >>> for _ in range(4):
        ...     opt.zero_grad(); (w ** 2).sum().backward(); opt.step()
        >>> bool(w.abs().max() < 2.0)
        True
    """

    _flat_keys = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int | str | AutoFreezeSettings = DEFAULT_FREEZE_STEP,
        bias_correction: bool = True,
        backend: Backend | None = None,
        **comm: Unpack[CommKeywords],
    ) -> None:
        check_adam_arguments(lr, betas, eps, weight_decay)
        comm = comm_keywords(type(self).__name__, comm)
        config = OnebitAdamConfig(freeze_step=freeze_step, **comm)
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction
        )
        super().__init__(params, defaults, config, backend)

    def _step(self, ctx: StepContext) -> None:
        step, freeze_step = ctx.step, ctx.freeze.last_full_step()
        observed = []
        for state in ctx.states:
            t = step - self.first_step(state)  # a group added later runs its own warmup
            m, v = state.flat["exp_avg"], state.flat["exp_avg_sq"]
            if t <= freeze_step:  # warmup: Adam on the averaged gradient
                g = ctx.averaged_grads(state)
                for seg, group in ctx.segments(state):
                    beta1, beta2 = group["betas"]
                    update_moments_(m[seg.slice], v[seg.slice], g[seg.slice], beta1, beta2)
                if self.first_step(state) == 0:
                    observed.append(state)
            else:  # compression: local gradient into m, then m is averaged at one bit
                if ctx.take(Kind.MOMENTUM, state) is None:  # (unless a DDP hook did it)
                    for seg, group in ctx.segments(state):
                        momentum_from_grads_(seg.views(m), seg.params, group["betas"][0])
                    ctx.exchange(state, m)
                ctx.mask(state, m)
            self._apply_update(state, t, freeze_step)
            state.count_idle(ctx.idle, IDLE_STEPS if t <= freeze_step else IDLE_STEPS[:1])
        automatic = auto_settings(self.config.freeze_step) is not None
        if observed and automatic and math.isinf(freeze_step):
            corrected = operator.itemgetter("bias_correction")
            ctx.freeze.observe(step, variance_level_of(observed, ctx.segments, step, corrected))

    def _early_plan(self, ops: BucketOps) -> WarmupThenMomentum:
        # m′ = β1·m + (1−β1)·g exchanged as step() exchanges m; without a gradient m·β1
        # (momentum_from_grads_)
        def exchange(state: FlatState, m: torch.Tensor, errors: dict, step: int) -> None:
            ops.exchange(state, m, errors)

        return WarmupThenMomentum(self.frozen_after, exchange, False)

    def _apply_update(self, state: FlatState, t: int, freeze_step: float) -> None:
        """p ← p − η·(m̂/(√v̂ + ε) + λ·p), group by group, with v̂'s bias factor frozen too;
        with ``step_guard``, in the compression stage |m̂/(√v̂ + ε)| ≤ B(β1, β2) (on the
        elements :func:`~commopt.optim.adam.guarded_elements` names). m̂ and v̂ count each
        parameter's own steps: t less the steps it sat out (``IDLE_STEPS``), as torch does."""
        runs = state.idle_runs(self.param_groups, IDLE_STEPS)
        bias_sqrt, step_sizes, eps, limits = [], [], [], []
        for _, group, (idle, idle_variance) in runs:
            beta1, beta2 = group["betas"]
            correct = group["bias_correction"]
            variance_t = min(t, freeze_step) - idle_variance
            bias_sqrt.append(variance_bias_sqrt(beta2, variance_t, correct))
            step_sizes.append(momentum_step_size(group["lr"], beta1, t - idle, correct))
            eps.append(group["eps"])
            bound = step_bound(self.config.step_guard, group["betas"], correct)
            # |m/d| ≤ B·lr/step_size, so that |m̂/d| ≤ B (lr = 0: nothing moves, any limit)
            limit = bound * group["lr"] / step_sizes[-1] if step_sizes[-1] else bound
            limits.append(limit if t > freeze_step else None)
        d = state.denominator(bias_sqrt, eps, [seg for seg, _, _ in runs])
        m = state.flat["exp_avg"]
        segments = [(seg, group) for seg, group, _ in runs]
        guarded_adam_update_(state, segments, m, d, step_sizes, limits, self.config.step_guard)
