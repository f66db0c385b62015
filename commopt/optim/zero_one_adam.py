"""0/1 Adam: Adam with a thinning variance schedule, 1-bit gradients, then local steps."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from torch.optim.optimizer import ParamsT

from commopt.comm import Backend
from commopt.compressed import NonFiniteError
from commopt.notices import sync_point_not_finite, warn_sync_diverged
from commopt.optim._agreement import nonfinite_ranks
from commopt.optim._early import Kind
from commopt.optim._layout import upgrade_zero_one_groups
from commopt.optim._zero_one import (
    StagedSync,
    ZeroOneSchedule,
    frozen_denominator,
    local_update_,
    sync_bucket_,
)
from commopt.optim.adam import (
    IDLE_STEPS,
    momentum_from_grads_,
    momentum_step_sizes,
    update_moments_,
    variance_level_of,
    variance_updates,
)
from commopt.optim.base import BucketOps, CompressedOptimizer, StepContext
from commopt.optim.config import (
    DEFAULT_FREEZE_STEP,
    CommKeywords,
    ZeroOneAdamConfig,
    check_adam_arguments,
    check_group_joins_phase_a,
    comm_keywords,
    configured_by,
)
from commopt.optim.flat_state import FlatState
from commopt.optim.freeze import AutoFreezeSettings, auto_settings, settled_step

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["ZeroOneAdam"]


@configured_by(ZeroOneAdamConfig)
class ZeroOneAdam(CompressedOptimizer):
    r"""0/1 Adam (Lu et al., 2023): fewer variance updates, 1-bit gradients, then local steps.

    β1, β2 are ``betas``; η is ``lr``; λ is ``weight_decay``; T_v is ``var_freeze_step``; g is
    this rank's gradient, ḡ its average over the n ranks and C the error-compensated 1-bit
    allreduce of SPEC §1. Steps are counted from 1. The formulas are SPEC §4's, without bias
    correction as in the paper's reference implementation (``bias_correction=False``); by
    default commopt uses v̂ = v/(1 − β2^k) and m̂ = m/(1 − β1^t) in their place (see
    ``bias_correction``).

    **Phase A** (t ≤ T_v). A *variance step* is one with t ≡ 0 (mod I_v); I_v starts at 1 and
    doubles after every ``var_update_scaler`` variance steps (from the next step on):

    .. math::
        \text{variance step:}\quad m ← β_1 m + (1-β_1)\,ḡ,\qquad v ← β_2 v + (1-β_2)\,ḡ^2 \\
        \text{other steps:}\quad m ← β_1 m + (1-β_1)\,\big(\mathrm{C}(g) \odot \text{mask}\big) \\
        p ← p - η\Big(\frac{m}{\sqrt v + ε} + λ p\Big)

    so v only ever sees full-precision averages and stays bit-identical on every rank.
    mask = ``exp_avg_mask`` ⊙ [v ≠ 0]: an element whose v is still exactly 0 (zero averaged
    gradient on every variance step so far) would get ±scale from the 1-bit code and a step
    m/ε; it stays put instead until a variance step gives it a variance, and in phase B its
    local gradient is discarded too (commopt's guard, not in SPEC §4 or DeepSpeed).

    **Phase B** (t > T_v), v frozen. On entry the error buffers are zeroed (they now compensate
    a different quantity) and p_sync = p. Every step is local, and a *sync step* is one with
    t ≡ 0 (mod I_l):

    .. math::
        m ← β_1 m + (1-β_1)\,g,\qquad p ← p - η\Big(\frac{m}{\sqrt v + ε} + λ p\Big),\qquad
        s ← s + η \\
        \text{sync:}\quad a = \mathrm{C}\big((p - p_{sync}) \odot (\sqrt v + ε)\big) \odot
        \text{mask},\qquad m ← -a/s,\qquad p ← p_{sync} + a/(\sqrt v + ε),\qquad
        p_{sync} ← p,\qquad s ← 0

    I_l starts at 1; after every ``local_step_scaler`` phase-B steps it becomes
    min(``local_step_clipper``, 2·I_l), from the next step on. Steps that are not sync steps
    communicate nothing at all. Between syncs the replicas' p and m differ (that is the
    algorithm); after each sync they are bit-identical again.

    Args:
        params: parameters or param groups; a group may carry ``exp_avg_mask``, a 0/1 tensor
            broadcastable to each of its parameters, applied after each compressed exchange
            (the 1-bit gradient in phase A, the accumulator a in phase B).
        lr: learning rate η (default 1e-3).
        betas: (β1, β2) (default (0.9, 0.999)).
        eps: ε added to the denominator (default 1e-8).
        weight_decay: decoupled weight decay λ (default 0).
        var_freeze_step: T_v, the last step of phase A (default 100000, >= 1), or ``"auto"``:
            phase A ends on the variance step at which the variance has settled
            (:class:`commopt.optim.freeze.AutoFreeze` on the bias-corrected level; with
            ``bias_correction=False`` also not before the uncorrected v has grown to within the
            threshold of its level, which takes :func:`commopt.optim.freeze.settled_step` variance
            updates: ≈ 2.3/(1 − β2));
            the step chosen is ``global_state["auto_freeze_step"]``. A
            :class:`commopt.AutoFreezeSettings` chooses the rule's constants (its threshold
            also sets the settled test); ``"auto"`` is ``AutoFreezeSettings()``.
        var_update_scaler: variance steps between doublings of I_v (default 16, >= 1).
        local_step_scaler: phase-B steps between doublings of I_l (default 32768, >= 1).
        local_step_clipper: the largest I_l (default 16, >= 1).
        bias_correction: per param group (default True): divide v by 1 − β2^k, k the variance
            updates it has had (since the group joined; frozen with v), and m by 1 − β1^t, t the
            steps since the group joined, as Adam does; phase B adds η/(1 − β1^t) to s. An
            intended difference from SPEC §4 and DeepSpeed (``False``): uncorrected, v frozen
            after k ≪ 1/(1 − β2) updates makes every later step 1/√(1 − β2^k) too large
            (docs/algorithms/zero_one_adam.md). k and t come from the shared schedule: nothing
            is exchanged or saved for them.
        backend: communication backend; ``None`` resolves as SPEC §5 (``commopt.init()``'s).
        {communication_options}

    With ``overlap=True`` a variance step's average, a 1-bit step's exchange and a sync step's
    local update and exchange start during backward, staged; ``step()`` redoes a sync whose lr
    (or other hyperparameter) changed after backward (docs/overlap.md). Local steps send
    nothing. Each param group has buckets of its own: a sync's 1-bit scale is per lr.

    Tuning: ``var_update_scaler`` trades variance freshness for communication (each variance
    step is a full-precision allreduce). ``var_freeze_step`` plays the role of 1-bit Adam's
    ``freeze_step``. ``local_step_clipper`` bounds how far replicas drift between syncs: larger
    saves rounds but lets local models diverge more on heterogeneous data.

    Non-finite gradients: on a step that communicates, every rank skips it and nothing changes.
    On a purely local step a rank with an inf/NaN gradient drops its own update (m and p stay),
    while the shared schedule (step, I_l, s) still advances so ranks stay in lock step; the next
    sync reconciles the replicas.

    Checkpoints: ``state_dict()`` holds both schedules, the phase (``global_state``:
    ``var_interval``, ``var_counter``, ``local_interval``, ``local_counter``, ``lrs`` per group,
    ``local_started``), p_sync (``state[p]["p_sync"]``) and this rank's error buffers. In phase
    B between syncs each rank's parameters and ``exp_avg`` are its own, so every rank must save
    and restore its own model and optimizer state for an exact resume.

    {schedule_and_resume}

    Differences from DeepSpeed's ``ZeroOneAdam``: ``bias_correction`` (DeepSpeed ignores its
    argument of that name); the phase, both schedules, p_sync and the
    learning-rate sum are restored on resume (DeepSpeed restarts the schedules and loses the
    phase flag, which desynchronises v across ranks); at n = 1 no gradient is dropped
    (DeepSpeed drops it on phase-A non-variance steps); p_sync replaces the subtracted-back
    accumulator so replicas are bit-identical after every sync; no hidden dry-run first step.

    References:
        Lu, Li, Zhang, De Sa, He. "Maximizing Communication Efficiency for Large-scale Training
        via 0/1 Adam." ICLR 2023, arXiv:2202.06009.

    Examples:
        >>> import torch, commopt
        >>> w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
        >>> opt = commopt.ZeroOneAdam([w], lr=0.1, var_freeze_step=3, var_update_scaler=1)
        >>> for _ in range(6):
        ...     opt.zero_grad(); (w ** 2).sum().backward(); opt.step()
        >>> bool(w.abs().max() < 2.0), opt.global_state["var_interval"]
        (True, 4)
    """

    _flat_keys = ("exp_avg", "exp_avg_sq")
    _lazy_flat_keys = ("p_sync",)
    _freeze_field: ClassVar[str] = "var_freeze_step"
    _late_cohorts: ClassVar[bool] = False  # v's schedule is global: refused once frozen
    _bucket_per_group: ClassVar[bool] = True  # a sync's 1-bit scale is per lr: per group

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        var_freeze_step: int | str | AutoFreezeSettings = DEFAULT_FREEZE_STEP,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32768,
        local_step_clipper: int = 16,
        backend: Backend | None = None,
        *,
        bias_correction: bool = True,
        **comm: Unpack[CommKeywords],
    ) -> None:
        check_adam_arguments(lr, betas, eps, weight_decay)
        comm = comm_keywords(type(self).__name__, comm)
        config = ZeroOneAdamConfig(
            **comm,
            var_freeze_step=var_freeze_step,
            var_update_scaler=var_update_scaler,
            local_step_scaler=local_step_scaler,
            local_step_clipper=local_step_clipper,
        )
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        defaults["bias_correction"] = bias_correction
        super().__init__(params, defaults, config, backend)
        self._start_schedule()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Parameters may join in phase A only: their variance is estimated on the variance
        steps that remain (they do not move until one gives them a variance). After
        ``var_freeze_step`` v is frozen, so new parameters could never get one."""
        gs = self.global_state
        check_group_joins_phase_a(gs["step"], self.frozen_after())
        super().add_param_group(param_group)
        # k of v̂ = v/(1 − β2^k) counts its variance updates from here (constructor's: from 0)
        interval, counter = gs.get("var_interval", 1), gs.get("var_counter", 0)
        k = variance_updates(interval, counter, self.config.var_update_scaler)
        self.param_groups[-1].setdefault("variance_offset", k)

    def load_state_dict(
        self, state_dict: dict[str, Any], *, allow_config_change: bool = False
    ) -> None:
        """As the base's, then the schedule over the loaded state and older groups upgraded."""
        super().load_state_dict(state_dict, allow_config_change=allow_config_change)
        self._start_schedule()  # over the loaded global_state
        upgrade_zero_one_groups(self.param_groups, self.config.var_update_scaler)

    # -- steps --------------------------------------------------------------------------------
    def _step(self, ctx: StepContext) -> None:
        if self._schedule.in_phase_a(ctx.step):
            self._phase_a_step(ctx)
        else:
            self._phase_b_step(ctx)

    def _communicates(self, step: int) -> bool:
        return self._schedule.communicates(step)

    def _skip_local(self, step: int) -> None:
        # this rank's m and p stay; the schedule shared by all ranks advances
        self._schedule.advance_local(momentum_step_sizes(self.param_groups, step))

    def _phase_a_step(self, ctx: StepContext) -> None:
        variance = self._schedule.is_variance_step(ctx.step)
        for state in ctx.states:
            m, v = state.flat["exp_avg"], state.flat["exp_avg_sq"]
            if variance:  # 1. a full-precision average updates both moments
                g = ctx.averaged_grads(state)  # (a DDP hook may have averaged it already)
            else:  # 2. the local gradient at one bit (at n = 1 g itself: nothing is dropped)
                g = ctx.take(Kind.GRADIENT, state)  # (a DDP hook may have done it)
                if g is None:
                    g = state.gather_grads(state.scratch("grad"))
                    ctx.exchange(state, g)
                ctx.mask(state, g)
            for seg, group in ctx.segments(state):
                beta1, beta2 = group["betas"]
                sl = seg.slice
                update_moments_(m[sl], v[sl] if variance else None, g[sl], beta1, beta2)
            self._local_update(state, ctx.step, updated=variance)  # 3.
            state.count_idle(ctx.idle, IDLE_STEPS if variance else IDLE_STEPS[:1])
        if variance:
            self._schedule.advance_variance()
            if auto_settings(self.config.var_freeze_step) is not None:
                self._observe(ctx)

    def _observe(self, ctx: StepContext) -> None:
        """The automatic freeze sees v̂'s level after k variance updates; a group without
        ``bias_correction`` (v used as it is) lets it freeze once (1 − β2^k) has settled."""
        gs = self.global_state
        k = gs["variance_updates"] = gs.get("variance_updates", 0) + 1
        states = [s for s in ctx.states if self.first_step(s) == 0]
        threshold = self.auto_freeze.threshold
        uncorrected = [g for s in states for _, g in ctx.segments(s) if not g["bias_correction"]]
        settled = max([1] + [settled_step(g["betas"][1], threshold) for g in uncorrected])
        level = variance_level_of(states, ctx.segments, k)
        ctx.freeze.observe(ctx.step, level, ready=k >= settled)

    def _phase_b_step(self, ctx: StepContext) -> None:
        step, schedule, groups = ctx.step, self._schedule, len(self.param_groups)
        sync = schedule.is_sync_step(step)  # before advance_local may double I_l
        if sync and self.overlap:  # staged during backward: committed if nothing changed
            diverged = self._early_plan(ctx.ops).commit(self.early_work, step)
            if diverged is not None:
                if diverged:
                    self._diverged()
                schedule.advance_local(momentum_step_sizes(self.param_groups, step))
                schedule.synced(groups)
                return
        if not self.global_state["local_started"]:  # errors now compensate accumulators
            for state in ctx.states:
                state.reset_comm()
                state.gather_params(state.buffer("p_sync"))
            schedule.enter_phase_b(groups)
        for state in ctx.states:  # 1. a local Adam step
            m = state.flat["exp_avg"]
            for seg, group in ctx.segments(state):
                momentum_from_grads_(seg.views(m), seg.params, group["betas"][0])
            # v is frozen at 0 there, so m/(√v+ε) would be m/ε; m was 0 there (masked at every
            # sync), so zeroing it now is the same as discarding the local gradient
            ctx.ops.discard_zero_variance(state, m, warn=True)
            self._local_update(state, step)
        schedule.advance_local(momentum_step_sizes(self.param_groups, step))  # s includes η
        if sync:  # 2.
            self._sync(ctx)
            schedule.synced(groups)

    def _sync(self, ctx: StepContext) -> None:
        """2. a = C((p − p_sync)⊙(√v+ε)) ⊙ mask; m ← −a/s; p ← p_sync + a/(√v+ε); p_sync ← p.
        A bucket whose accumulator is inf/NaN on any rank (a replica diverged) is refused by the
        exchange on every rank alike, before any error buffer changes, and returns to its last
        synced point everywhere (p ← p_sync, m ← 0; :meth:`_diverged`): replicas stay identical."""
        diverged = False
        lrs, guard = self.global_state["lrs"], self.config.step_guard
        for state in ctx.states:
            m, p_sync = state.flat["exp_avg"], state.buffer("p_sync")
            acc = state.gather_params(state.scratch("grad")).sub_(p_sync)
            d = frozen_denominator(state, ctx.groups, self._schedule.variance_updates())
            try:
                sync_bucket_(ctx.ops, state, ctx.groups, d, acc, m, p_sync, lrs, guard)
            except NonFiniteError:
                state.set_params(p_sync)
                m.zero_()
                diverged = True
                continue
            state.set_params(acc)
            state.gather_params(p_sync)  # p as stored (bf16 parameters round)
        if diverged:
            self._diverged()

    def _diverged(self) -> None:
        """Every rank went back to p_sync: warned, or raised everywhere if p_sync/v is inf/NaN."""
        self.global_state["skipped_steps"] += 1  # (a later sync would go back there again)
        flat = [s.flat[k] for s in self.flat_states for k in ("p_sync", "exp_avg_sq")]
        if bad := nonfinite_ranks(self.backend, flat):
            raise RuntimeError(sync_point_not_finite(bad, self.global_state["step"]))
        warn_sync_diverged()

    def _local_update(self, state: FlatState, step: int, updated: bool = False) -> None:
        """p ← p − η·(m/(√v̂ + ε) + λ·p), guarded (``updated``: v had its update of this step,
        not yet counted by the schedule)."""
        k = self._schedule.variance_updates() + updated
        d = frozen_denominator(state, self.param_groups, k)
        step_sizes = momentum_step_sizes(self.param_groups, step)
        own = step if self._schedule.in_phase_a(step) else None
        guard = self.config.step_guard
        local_update_(state, self.param_groups, step_sizes, d, guard, own_steps_at=own)

    # -- overlap=True: the sync staged during backward (commopt.optim._zero_one) --------------
    def _start_schedule(self) -> None:
        """The schedule over ``global_state`` (anew after a load)."""
        self._schedule = ZeroOneSchedule(self.global_state, self.frozen_after, self.config)

    def _early_plan(self, ops: BucketOps) -> StagedSync:
        # holds no state of its own: step() commits through a plan built alike
        groups, states = (lambda: self.param_groups), (lambda: self.flat_states)
        guard = self.config.step_guard
        return StagedSync(self._schedule, ops, groups, states, self.overlap, guard)
