"""0/1 Adam: Adam with a thinning variance schedule, 1-bit gradients, then local steps."""

from __future__ import annotations

from typing import Any

import torch

from commopt.buckets import Bucket
from commopt.comm import Backend
from commopt.optim.base import (
    CompressedOptimizer,
    check_adam_arguments,
    check_step_count,
)

__all__ = ["ZeroOneAdam"]


class ZeroOneAdam(CompressedOptimizer):
    r"""0/1 Adam (Lu et al., 2023): fewer variance updates, 1-bit gradients, then local steps.

    β1, β2 are ``betas``; η is ``lr``; λ is ``weight_decay``; T_v is ``var_freeze_step``; g is
    this rank's gradient, ḡ its average over the n ranks and C the error-compensated 1-bit
    allreduce of SPEC §1. No bias correction, as in the paper's reference implementation.
    Steps are counted from 1.

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
        var_freeze_step: T_v, the last step of phase A (default 100000, >= 1).
        var_update_scaler: variance steps between doublings of I_v (default 16, >= 1).
        local_step_scaler: phase-B steps between doublings of I_l (default 32768, >= 1).
        local_step_clipper: the largest I_l (default 16, >= 1).
        backend: communication backend; ``None`` resolves as SPEC §5 (``commopt.init()``'s).

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

    Differences from DeepSpeed's ``ZeroOneAdam``: the phase, both schedules, p_sync and the
    learning-rate sum are restored on resume (DeepSpeed restarts the schedules and loses the
    phase flag, which desynchronises v across ranks); at n = 1 no gradient is dropped
    (DeepSpeed drops it on phase-A non-variance steps); p_sync replaces the subtracted-back
    accumulator so replicas are bit-identical after every sync; no hidden dry-run first step.

    References:
        Lu, Li, Zhang, De Sa, He. "Maximizing Communication Efficiency for Large-scale Training
        via 0/1 Adam." ICLR 2023, arXiv:2202.06009.

    Example:
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

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        var_freeze_step: int = 100_000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32768,
        local_step_clipper: int = 16,
        backend: Backend | None = None,
    ) -> None:
        check_adam_arguments(lr, betas, eps, weight_decay)
        check_step_count(
            "var_freeze_step",
            var_freeze_step,
            1,
            "the variance has to be estimated before it is frozen",
        )
        why = "it counts steps between doublings of an interval"
        check_step_count("var_update_scaler", var_update_scaler, 1, why)
        check_step_count("local_step_scaler", local_step_scaler, 1, why)
        check_step_count(
            "local_step_clipper", local_step_clipper, 1, "it is the largest local-step interval"
        )
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        super().__init__(params, defaults, backend)
        self.global_state.update(
            var_interval=1,  # I_v: variance steps are t ≡ 0 (mod I_v)
            var_counter=0,  # variance steps since I_v last doubled
            local_interval=1,  # I_l: sync steps are t ≡ 0 (mod I_l) in phase B
            local_counter=0,  # phase-B steps since I_l last doubled
            local_started=False,  # phase B entered: errors zeroed, p_sync set
            lrs=[],  # s, per param group: Σ η over the phase-B steps since the last sync
        )

    # -- schedule -----------------------------------------------------------------------------
    def _is_variance_step(self, step: int) -> bool:
        return step <= self.var_freeze_step and step % self.global_state["var_interval"] == 0

    def _is_sync_step(self, step: int) -> bool:
        return step > self.var_freeze_step and step % self.global_state["local_interval"] == 0

    def _communicates(self, step: int) -> bool:
        return step <= self.var_freeze_step or self._is_sync_step(step)

    def _advance_local(self) -> None:
        """After every phase-B step: s += η; every local_step_scaler steps, I_l doubles."""
        gs = self.global_state
        lrs = list(gs["lrs"]) + [0.0] * (len(self.param_groups) - len(gs["lrs"]))
        gs["lrs"] = [s + g["lr"] for s, g in zip(lrs, self.param_groups, strict=True)]
        gs["local_counter"] += 1
        if gs["local_counter"] == self.local_step_scaler:
            gs["local_counter"] = 0
            gs["local_interval"] = min(self.local_step_clipper, 2 * gs["local_interval"])

    # -- steps --------------------------------------------------------------------------------
    def _step(self, step: int) -> None:
        if step <= self.var_freeze_step:
            self._phase_a_step(step)
        else:
            self._phase_b_step(step)

    def _skip_local(self, step: int) -> None:
        del step  # this rank's m and p stay; the schedule shared by all ranks advances
        self._advance_local()

    def _phase_a_step(self, step: int) -> None:
        variance = self._is_variance_step(step)
        for bi, bucket in enumerate(self._buckets or []):
            m, v = self._flat[bi]["exp_avg"], self._flat[bi]["exp_avg_sq"]
            g = self._gather_grads(bucket, self._scratch_buffer(bi, "grad"))
            if variance:
                self._average(g)
            else:  # at n = 1 this is g itself: nothing is dropped
                self._compress(bi, g)
                self._mask(bi, g)
            for seg in bucket.segments:
                beta1, beta2 = self.param_groups[seg.group]["betas"]
                sl = slice(seg.start, seg.stop)
                m[sl].lerp_(g[sl], 1 - beta1)
                if variance:
                    v[sl].mul_(beta2).addcmul_(g[sl], g[sl], value=1 - beta2)
            if variance:
                self._variance_changed(bi)
            self._adam_update(bi, bucket, m)
        if variance:
            gs = self.global_state
            gs["var_counter"] += 1
            if gs["var_counter"] == self.var_update_scaler:
                gs["var_counter"] = 0
                gs["var_interval"] *= 2

    def _phase_b_step(self, step: int) -> None:
        gs = self.global_state
        sync = self._is_sync_step(step)  # before _advance_local may double the interval
        if not gs["local_started"]:
            self._reset_errors()  # they compensated gradients; now they compensate accumulators
            for bi, bucket in enumerate(self._buckets or []):
                self._gather_params(bucket, self._flat_buffer(bi, "p_sync"))
            gs["lrs"] = [0.0] * len(self.param_groups)
            gs["local_started"] = True
        for bi, bucket in enumerate(self._buckets or []):
            m = self._flat[bi]["exp_avg"]
            self._momentum_from_local_grads(bucket, m)
            # v is frozen at 0 there, so m/(√v+ε) would be m/ε; m was 0 there (masked at every
            # sync), so zeroing it now is the same as discarding the local gradient
            self._discard_zero_variance(bi, m)
            self._adam_update(bi, bucket, m)
        self._advance_local()  # s now includes this step's η
        if sync:
            for bi, bucket in enumerate(self._buckets or []):
                self._sync(bi, bucket)
            gs["lrs"] = [0.0] * len(self.param_groups)

    def _sync(self, bi: int, bucket: Bucket) -> None:
        """a = C((p − p_sync)⊙(√v+ε)) ⊙ mask; m ← −a/s; p ← p_sync + a/(√v+ε); p_sync ← p."""
        m = self._flat[bi]["exp_avg"]
        p_sync = self._flat_buffer(bi, "p_sync")
        acc = self._gather_params(bucket, self._scratch_buffer(bi, "grad")).sub_(p_sync)
        denom = self._denominator(bi, [1.0] * len(bucket.segments))  # √v + ε, read-only
        acc.mul_(denom)
        self._compress(bi, acc)
        self._mask(bi, acc)
        for seg in bucket.segments:
            sl = slice(seg.start, seg.stop)
            lrs = self.global_state["lrs"][seg.group]
            if lrs > 0:
                torch.div(acc[sl], -lrs, out=m[sl])
            else:  # η was 0 since the last sync: nothing moved, no momentum to recover
                m[sl].zero_()
        acc.div_(denom).add_(p_sync)
        self._set_params(bucket, acc)
        self._gather_params(bucket, p_sync)  # p as stored (bf16 parameters round)

    def _adam_update(self, bi: int, bucket: Bucket, m: torch.Tensor) -> None:
        """p ← p − η·(m/(√v + ε) + λ·p), segment by segment, one ``addcdiv`` per group; √v + ε
        is recomputed only when v changed (``_denominator``)."""
        d = self._denominator(bi, [1.0] * len(bucket.segments))
        for seg in bucket.segments:
            group = self.param_groups[seg.group]
            lr, wd = group["lr"], group["weight_decay"]
            if wd != 0:
                torch._foreach_mul_(list(seg.params), 1 - lr * wd)
            torch._foreach_addcdiv_(list(seg.params), seg.views(m), seg.views(d), value=-lr)
