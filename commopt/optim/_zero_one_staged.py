r"""0/1 Adam's phase-B sync with ``overlap=True``: staged during backward, checked in ``step()``.

A sync (:meth:`ZeroOneAdam._sync <commopt.optim.zero_one_adam.ZeroOneAdam>`) exchanges
a = C((p′ − p_sync)⊙(√v̂ + ε)), p′ the parameters after this step's local update, which reads lr,
weight decay, β1 and ε. With ``overlap=True`` the communication thread does not wait for
``step()``: once a bucket's last gradient has been folded into its staged momentum m′
(:mod:`commopt.optim.early`), it computes the bucket's local update into a *staged* p′ (never
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

:class:`StagedSync` is 0/1 Adam's :class:`~commopt.optim.early.EarlyPlan`; it runs the
algorithm's own steps (:class:`SyncSteps`, handed over by the optimizer), so the staged sync and
``step()``'s are one code path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from commopt.compressed import NonFiniteError
from commopt.optim.early import EarlyWork, Kind, StagedBuffers
from commopt.optim.flat_state import FlatState

if TYPE_CHECKING:
    from commopt.optim._zero_one_schedule import ZeroOneSchedule
    from commopt.optim.base import CompressedOptimizer

__all__ = ["StagedSync", "SyncSteps"]


@dataclasses.dataclass(frozen=True)
class SyncSteps:
    """The steps of 0/1 Adam that a staged sync runs, as ``step()`` runs them."""

    #: the compressed exchange: ``compress(state, flat, errors)``
    compress: Callable[..., torch.Tensor]
    #: m ← 0 where v = 0: ``discard_zero_variance(state, m)``
    discard_zero_variance: Callable[[FlatState, torch.Tensor], None]
    #: the local Adam step: ``local_update(state, step, m=m, target=p)``
    local_update: Callable[..., None]
    #: one bucket's sync: ``sync_bucket(state, acc, m, p_sync, lrs, errors)``
    sync_bucket: Callable[..., None]
    #: η/(1 − β1^t) per param group: ``step_sizes(step)``
    step_sizes: Callable[[int], list[float]]
    #: a replica diverged, every rank returned to p_sync: count, check p_sync, warn
    diverged: Callable[[], None]


class StagedSync:
    """0/1 Adam's :class:`~commopt.optim.early.EarlyPlan`: a variance step's average and a
    1-bit step's gradient exchange may start during backward (DDP hook or overlap); with
    ``overlap=True`` also a sync step, staged. Local steps send nothing; the DDP hook leaves
    syncs to ``step()`` (docs/ddp.md). :meth:`commit` takes a staged sync in ``step()``."""

    fold_missing_as_zero = False

    def __init__(
        self, opt: CompressedOptimizer, schedule: ZeroOneSchedule, steps: SyncSteps
    ) -> None:
        self._opt, self._schedule, self._steps = opt, schedule, steps

    def kind(self, state: FlatState, step: int) -> Kind | None:
        if self._schedule.is_variance_step(step):
            return Kind.AVERAGE
        if step <= self._opt.frozen_after():
            return Kind.GRADIENT
        if self._opt.overlap and self._schedule.is_sync_step(step):
            if all(p.dtype == torch.float32 for p in state.bucket.params):
                return Kind.SYNC
        return None

    def snapshot(self) -> tuple[Any, ...]:
        """What a staged sync reads besides the buffers: every group's hyperparameters (a
        tensor by identity), s, the phase flag."""
        groups = tuple(
            tuple((k, id(v) if torch.is_tensor(v) else v) for k, v in sorted(g.items()))
            for g in ({k: v for k, v in g.items() if k != "params"} for g in self._opt.param_groups)
        )
        gs = self._opt.global_state
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
        steps = self._steps
        if step <= self._opt.frozen_after():
            steps.compress(state, m, errors)
            return None
        gs, snapshot = self._opt.global_state, self.snapshot()
        entry = not gs["local_started"]
        p = staged.gradient(state)  # the staged p′, then a, then p_sync + a/(√v̂ + ε)
        state.gather_params(p)
        if entry:  # phase B starts: p_sync = p, error feedback starts over
            p_sync = staged.sync_base(state).copy_(p)
            for e in errors.values():
                e.zero_()
        else:
            p_sync = state.flat["p_sync"]
        steps.discard_zero_variance(state, m)
        steps.local_update(state, step, m=m, target=p)
        lrs = list(gs["lrs"]) if not entry else []
        lrs += [0.0] * (len(self._opt.param_groups) - len(lrs))
        lrs = [s + eta for s, eta in zip(lrs, steps.step_sizes(step), strict=True)]
        try:
            steps.sync_bucket(state, p.sub_(p_sync), m, p_sync, lrs, errors)
        except NonFiniteError:  # on every rank alike: step() returns this bucket to p_sync
            return snapshot, True
        return snapshot, False

    def commit(self, work: EarlyWork, step: int) -> bool:
        """In ``step()``, before the phase-B step changes anything: commit the staged sync of
        step ``step`` if the hyperparameters it read are unchanged (buckets not staged yet are
        staged now, in layout order); False: nothing staged, or something changed — the caller
        runs the sync synchronously (the staged work is dropped when ``step()`` ends)."""
        if not work.started_any(step):
            return False
        now, states = self.snapshot(), self._opt.flat_states
        for state in states:
            st = work.current(state, step)
            if st is None:
                continue
            if (st.outcome is not None and st.outcome[0] != now) or st.seen not in (None, now):
                return False
        outcomes = [work.complete(state, step).outcome for state in states]
        gs = self._opt.global_state
        entry = not gs["local_started"]
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
            gs["lrs"] = [0.0] * len(self._opt.param_groups)
            gs["local_started"] = True
        if diverged:
            self._steps.diverged()
        return True
