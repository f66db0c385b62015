r"""0/1 Adam's machinery beside the paper file: its two schedules, its update and sync as
functions of explicit arguments, and its sync staged during backward.

**The schedules** (SPEC §4): variance steps that thin out in phase A, sync steps that spread
out in phase B. Both are functions of the shared schedule state alone (kept in the optimizer's
``global_state``, saved with it), so every rank takes the same decision at the same step with
no message (:class:`ZeroOneSchedule`).

**The update and the sync** (:func:`local_update_`, :func:`sync_bucket_`), one code path for
``step()`` and the staged sync.

**The staged sync** (:class:`StagedSync`).
A sync exchanges
a = C((p′ − p_sync)⊙(√v̂ + ε)), p′ the parameters after this step's local update, which reads lr,
weight decay, β1 and ε. With ``overlap=True`` the communication thread does not wait for
``step()``: once a bucket's last gradient has been folded into its staged momentum m′
(:mod:`commopt.optim._early`), it computes the bucket's local update into a *staged* p′ (never
the parameters), with the hyperparameters as ``param_groups`` hold them at that moment, and runs
the sync's exchange on staged error buffers; m ← −a/s and p ← p_sync + a/(√v̂ + ε) are staged
too. It records what it read: every group's hyperparameters (a tensor such as ``exp_avg_mask``
by identity), s and the phase flag; the main thread records the same when it queues the job,
during backward.

``step()`` (after the agreement on non-finite gradients, which skips the step with everything
untouched) compares both with ``param_groups`` as they are now. All equal: it commits the
staged results — exactly what the synchronous path would have written. Anything changed (an lr
scheduler stepped between backward and ``step()``): it drops the staged work and runs the sync
synchronously. Same bits as ``overlap=False`` either way; the fallback costs the exchange
again. The main thread's record makes the decision the same on every rank whether the thread's
job ran before or after such a change; every rank must change its hyperparameters alike (as
without overlap). Not detected: a value changed during backward and changed back before
``step()`` (the thread may have read either), or a tensor hyperparameter changed in place.

Memory: the staged p′ (L fp32 per bucket of L elements, the staged-gradient buffer, unused in
phase B) on top of the staged m′ and error buffers; at the first phase-B step, a staged copy of
p_sync as well.

:class:`StagedSync` is 0/1 Adam's :class:`~commopt.optim._early.EarlyPlan`; it runs the
algorithm's own steps (:class:`SyncSteps`, handed over by the optimizer), so the staged sync and
``step()``'s are one code path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from commopt.choices import StepGuard
from commopt.compressed import NonFiniteError
from commopt.optim._early import Kind, StagedBuffers
from commopt.optim._early._work import EarlyWork
from commopt.optim.adam import (
    IDLE_STEPS,
    bound_step_,
    guard_limits,
    guarded_adam_update_,
    guarded_elements,
    momentum_step_size,
    momentum_step_sizes,
    step_bound,
    variance_denominator,
    variance_updates,
)
from commopt.optim.flat_state import FlatState, grouped_segments

if TYPE_CHECKING:
    from commopt.optim.base import BucketOps
    from commopt.optim.config import ZeroOneAdamConfig

__all__ = ["StagedSync", "ZeroOneSchedule", "local_update_", "sync_bucket_"]


class ZeroOneSchedule:
    """I_v and I_l over the state they live in (``state``: the optimizer's ``global_state``;
    ``frozen_after``: T_v, the last step of phase A, as it is now; ``config``: the scalers)."""

    #: the schedule's keys in ``global_state`` and their values at step 0
    START: dict[str, Any] = {  # noqa: RUF012 - read-only, copied by start()
        "var_interval": 1,  # I_v: variance steps are t ≡ 0 (mod I_v)
        "var_counter": 0,  # variance steps since I_v last doubled
        "local_interval": 1,  # I_l: sync steps are t ≡ 0 (mod I_l) in phase B
        "local_counter": 0,  # phase-B steps since I_l last doubled
        "local_started": False,  # phase B entered: errors zeroed, p_sync set
        "lrs": [],  # s, per param group: Σ η over the phase-B steps since the last sync
    }

    def __init__(
        self, state: dict[str, Any], frozen_after: Callable[[], float], config: ZeroOneAdamConfig
    ) -> None:
        self.state = state
        self._frozen_after = frozen_after
        self._var_scaler = config.var_update_scaler
        self._local_scaler = config.local_step_scaler
        self._clipper = config.local_step_clipper
        for key, value in self.START.items():
            state.setdefault(key, list(value) if isinstance(value, list) else value)

    def in_phase_a(self, step: int) -> bool:
        """t ≤ T_v: the variance is still updated (on variance steps)."""
        return step <= self._frozen_after()

    def variance_updates(self) -> int:
        """Variance updates so far (all ranks alike, from the schedule state)."""
        return variance_updates(
            self.state["var_interval"], self.state["var_counter"], self._var_scaler
        )

    def is_variance_step(self, step: int) -> bool:
        """Phase A, t ≡ 0 (mod I_v): the gradient is averaged at full precision, v updated."""
        return step <= self._frozen_after() and step % self.state["var_interval"] == 0

    def is_sync_step(self, step: int) -> bool:
        """Phase B, t ≡ 0 (mod I_l): the replicas are synced."""
        return step > self._frozen_after() and step % self.state["local_interval"] == 0

    def communicates(self, step: int) -> bool:
        """Every phase-A step talks to the other ranks; in phase B only the syncs do."""
        return step <= self._frozen_after() or self.is_sync_step(step)

    def advance_variance(self) -> None:
        """After every variance step: every var_update_scaler of them, I_v doubles."""
        gs = self.state
        gs["var_counter"] += 1
        if gs["var_counter"] == self._var_scaler:
            gs["var_counter"] = 0
            gs["var_interval"] *= 2

    def advance_local(self, step_sizes: Sequence[float]) -> None:
        """After every phase-B step: s += η (``step_sizes``, per param group); every
        local_step_scaler steps, I_l doubles (up to local_step_clipper)."""
        gs = self.state
        lrs = list(gs["lrs"]) + [0.0] * (len(step_sizes) - len(gs["lrs"]))
        gs["lrs"] = [s + eta for s, eta in zip(lrs, step_sizes, strict=True)]
        gs["local_counter"] += 1
        if gs["local_counter"] == self._local_scaler:
            gs["local_counter"] = 0
            gs["local_interval"] = min(self._clipper, 2 * gs["local_interval"])

    def enter_phase_b(self, groups: int) -> None:
        """Phase B starts (with its first local step, or its staged sync): s = 0 per group."""
        self.synced(groups)
        self.state["local_started"] = True

    def synced(self, groups: int) -> None:
        """A sync committed: s = 0 per group (``groups`` param groups)."""
        self.state["lrs"] = [0.0] * groups


def frozen_denominator(
    state: FlatState, groups: Sequence[dict[str, Any]], variance_updates: int
) -> torch.Tensor:
    """√v̂ + ε of the bucket after ``variance_updates`` variance updates (read-only, kept)."""
    return variance_denominator(state, groups, variance_updates)


def local_update_(
    state: FlatState,
    groups: Sequence[dict[str, Any]],
    step_sizes: Sequence[float],
    d: torch.Tensor,
    step_guard: StepGuard,
    m: torch.Tensor | None = None,
    target: torch.Tensor | None = None,
    own_steps_at: int | None = None,
) -> None:
    """p ← p − η·(m/(√v̂ + ε) + λ·p), group by group, guarded; ``step_sizes``: η/(1 − β1^t)
    per param group; ``d``: √v̂ + ε; ``m``: ``exp_avg`` unless given (a staged m′);
    ``target``: a flat buffer that takes p′ in place of the parameters (the staged sync).
    ``own_steps_at`` (phase A's step): each parameter's t counts its own steps, less those it
    sat out (``IDLE_STEPS``), in place of ``step_sizes``; phase B keeps the group's t, whose
    step sizes the sync sums to recover m."""
    m = state.flat["exp_avg"] if m is None else m
    if own_steps_at is None:
        segments = grouped_segments(state, groups)
        sizes = [step_sizes[seg.group] for seg, _ in segments]
    else:
        runs = state.idle_runs(groups, IDLE_STEPS)
        segments = [(seg, g) for seg, g, _ in runs]
        t = own_steps_at
        sizes = [
            momentum_step_size(
                g["lr"], g["betas"][0], t - g["first_step"] - idle, g["bias_correction"]
            )
            for _, g, (idle, _) in runs
        ]
    limits = guard_limits(segments, sizes, step_guard)
    guarded_adam_update_(state, segments, m, d, sizes, limits, step_guard, target)


def sync_bucket_(
    ops: BucketOps,
    state: FlatState,
    groups: Sequence[dict[str, Any]],
    d: torch.Tensor,
    acc: torch.Tensor,
    m: torch.Tensor,
    p_sync: torch.Tensor,
    lrs: Sequence[float],
    step_guard: StepGuard,
    errors: dict[str, torch.Tensor] | None = None,
) -> None:
    """One bucket's sync, in ``step()`` and staged alike: ``acc`` = p′ − p_sync on entry;
    a = C(acc⊙d) ⊙ mask with d = √v̂ + ε (``errors``: the error buffers to use, default the
    committed ones); m ← −a/s per group (0 where s = ``lrs`` is 0); acc ← p_sync + a/d, each
    element's move bounded by s·B where the step guard applies. Raises NonFiniteError (every
    rank alike, no error buffer changed) if acc is non-finite on any rank."""
    acc.mul_(d)
    ops.exchange(state, acc, errors)
    ops.mask(state, acc, groups)
    for seg in state.bucket.segments:
        if lrs[seg.group] > 0:
            torch.div(acc[seg.slice], -lrs[seg.group], out=m[seg.slice])
        else:  # η was 0 since the last sync: nothing moved, no momentum to recover
            m[seg.slice].zero_()
    acc.div_(d)
    for seg, group in grouped_segments(state, groups):  # s lr-weighted steps of at most B
        where = guarded_elements(step_guard, state, seg)
        bound = step_bound(step_guard, group["betas"], group["bias_correction"]) * lrs[seg.group]
        if where is not None and lrs[seg.group] > 0 and math.isfinite(bound):
            bound_step_(acc[seg.slice], bound, where)
    acc.add_(p_sync)


class StagedSync:
    """0/1 Adam's :class:`~commopt.optim._early.EarlyPlan`: a variance step's average and a
    1-bit step's gradient exchange may start during backward (DDP hook or overlap); with
    ``overlap=True`` also a sync step, staged. Local steps send nothing; the DDP hook leaves
    syncs to ``step()`` (docs/ddp.md). :meth:`commit` takes a staged sync in ``step()``.

    Args:
        schedule: the schedule over the optimizer's ``global_state``.
        ops: the exchange and the mask (:class:`~commopt.optim.base.BucketOps`).
        groups: the param groups as they are now.
        states: the buckets as they are now.
        overlap: the optimizer's ``overlap`` (without it, syncs run in ``step()``).
        step_guard: the config's ``step_guard``.
    """

    fold_missing_as_zero = False

    def __init__(
        self,
        schedule: ZeroOneSchedule,
        ops: BucketOps,
        groups: Callable[[], list[dict[str, Any]]],
        states: Callable[[], list[FlatState]],
        overlap: bool,
        step_guard: StepGuard,
    ) -> None:
        self._schedule, self._ops, self._groups, self._states = schedule, ops, groups, states
        self._overlap, self._guard = overlap, step_guard

    def kind(self, state: FlatState, step: int) -> Kind | None:
        if self._schedule.is_variance_step(step):
            return Kind.AVERAGE
        if self._schedule.in_phase_a(step):
            return Kind.GRADIENT
        if self._overlap and self._schedule.is_sync_step(step):
            if all(p.dtype == torch.float32 for p in state.bucket.params):
                return Kind.SYNC
        return None

    def snapshot(self) -> tuple[Any, ...]:
        """What a staged sync reads besides the buffers: every group's hyperparameters (a
        tensor by identity), s, the phase flag."""
        groups = tuple(
            tuple((k, id(v) if torch.is_tensor(v) else v) for k, v in sorted(g.items()))
            for g in ({k: v for k, v in g.items() if k != "params"} for g in self._groups())
        )
        gs = self._schedule.state
        return groups, tuple(gs["lrs"]), gs["local_started"]

    @torch.no_grad()  # (grad mode is per thread: the communication thread's too)
    def exchange(
        self,
        state: FlatState,
        m: torch.Tensor,
        errors: dict[str, torch.Tensor],
        step: int,
        staged: StagedBuffers,
    ) -> object:
        """Phase A: the gradient at one bit. A sync step: the bucket's local update and sync
        on staged buffers, m′ (folded) → m, a staged p′ → p, ``errors`` (staged copies), as
        ``step()`` would write them; returns (what it read, diverged)."""
        if self._schedule.in_phase_a(step):
            self._ops.exchange(state, m, errors)
            return None
        gs, snapshot, groups = self._schedule.state, self.snapshot(), self._groups()
        entry = not gs["local_started"]
        p = staged.gradient(state)  # the staged p′, then a, then p_sync + a/(√v̂ + ε)
        state.gather_params(p)
        if entry:  # phase B starts: p_sync = p, error feedback starts over
            p_sync = staged.sync_base(state).copy_(p)
            for e in errors.values():
                e.zero_()
        else:
            p_sync = state.flat["p_sync"]
        self._ops.discard_zero_variance(state, m, warn=False)
        d = frozen_denominator(state, groups, self._schedule.variance_updates())
        step_sizes = momentum_step_sizes(groups, step)
        local_update_(state, groups, step_sizes, d, self._guard, m=m, target=p)
        lrs = list(gs["lrs"]) if not entry else []
        lrs += [0.0] * (len(groups) - len(lrs))
        lrs = [s + eta for s, eta in zip(lrs, step_sizes, strict=True)]
        try:
            sync_bucket_(
                self._ops, state, groups, d, p.sub_(p_sync), m, p_sync, lrs, self._guard, errors
            )
        except NonFiniteError:  # on every rank alike: step() returns this bucket to p_sync
            return snapshot, True
        return snapshot, False

    def commit(self, work: EarlyWork, step: int) -> bool | None:
        """In ``step()``, before the phase-B step changes anything: commit the staged sync of
        step ``step`` if the hyperparameters it read are unchanged (buckets not staged yet are
        staged now, in layout order). Returns whether a replica diverged (every bucket that did
        is back at p_sync, on every rank); None: nothing staged, or something changed — the
        caller runs the sync synchronously (the staged work is dropped when ``step()`` ends)."""
        if not work.started_any(step):
            return None
        now, states = self.snapshot(), self._states()
        for state in states:
            st = work.current(state, step)
            if st is None:
                continue
            if (st.outcome is not None and st.outcome[0] != now) or st.seen not in (None, now):
                return None
        outcomes = [work.complete(state, step).outcome for state in states]
        entry = not self._schedule.state["local_started"]
        diverged = False
        for state, (_, failed) in zip(states, outcomes, strict=True):
            if entry:
                state.reset_comm()
            if failed:
                base = work.buffers.sync_base(state) if entry else state.flat["p_sync"]
                state.set_params(base)
                if entry:
                    state.buffer("p_sync").copy_(base)
                state.flat["exp_avg"].zero_()
                diverged = True
                continue
            state.set_params(work.buffers.gradient(state))
            state.flat["exp_avg"].copy_(work.buffers.momentum(state))
            work.buffers.swap_errors_into(state)
            state.gather_params(state.buffer("p_sync"))  # p as stored
        if entry:
            self._schedule.enter_phase_b(len(self._groups()))
        return diverged
