r"""0/1 Adam's phase-B sync steps with ``overlap=True``: staged during backward, checked in
``step()``.

A sync exchanges a = C((p′ − p_sync)⊙(√v̂ + ε)), p′ the parameters after this step's local
update, which reads lr, weight decay, β1 and ε. With ``overlap=True`` the communication thread
does not wait for ``step()``: once a bucket's last gradient has been folded into its staged
momentum m′ (:mod:`commopt.optim.early`), it computes the bucket's local update into a *staged*
p′ (never the parameters), with the hyperparameters as ``param_groups`` hold them at that
moment, and runs the sync's exchange on staged error buffers; m ← −a/s and p ← p_sync +
a/(√v̂ + ε) are staged too. It records what it read: every group's hyperparameters (a tensor
such as ``exp_avg_mask`` by identity), s and the phase flag; the main thread records the same
when it queues the job, during backward.

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
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from commopt.compressed import NonFiniteError
from commopt.optim.early_kind import Kind
from commopt.optim.staged import StagedWork
from commopt.optim.user_warning import warn_at_caller
from commopt.step_guard import bound_step_, guarded_elements

if TYPE_CHECKING:
    from commopt.optim.flat_state import FlatState

__all__ = ["SYNC", "ZeroOneSync", "commit_staged_sync", "sync_bucket_", "warn_diverged"]

#: the step is a phase-B sync: fold the gradient, stage the local update and the sync
SYNC = Kind.SYNC


def warn_diverged() -> None:
    warn_at_caller(
        "ZeroOneAdam: non-finite parameters at a sync step on at least one rank; every "
        "rank returns to the last synced parameters there (p = p_sync, m = 0)"
    )


def _snapshot(opt: Any) -> tuple[Any, ...]:
    """What the staged sync reads besides the buffers: every group's hyperparameters, s, the
    phase flag."""
    groups = tuple(
        tuple((k, id(v) if torch.is_tensor(v) else v) for k, v in sorted(g.items()))
        for g in ({k: v for k, v in g.items() if k != "params"} for g in opt.param_groups)
    )
    gs = opt.global_state
    return groups, tuple(gs["lrs"]), gs["local_started"]


class ZeroOneSync:
    """The early-work part of :class:`commopt.ZeroOneAdam` (a mixin)."""

    if TYPE_CHECKING:
        global_state: dict[str, Any]
        param_groups: list[dict[str, Any]]
        _overlap: bool

        def _is_variance_step(self, step: int) -> bool: ...

        def _is_sync_step(self, step: int) -> bool: ...

        def frozen_after(self) -> float: ...

        def _compress(
            self, state: FlatState, flat: torch.Tensor, comm: dict[str, torch.Tensor] | None = None
        ) -> torch.Tensor: ...

    def _early_kind(self, state: FlatState, step: int) -> Kind | None:
        """A variance step's average and a 1-bit step's gradient exchange may start during
        backward (DDP hook or overlap); with ``overlap=True`` also a sync step, staged
        (this module). Local steps send nothing; the DDP hook leaves syncs to ``step()``
        (docs/ddp.md)."""
        if self._is_variance_step(step):
            return Kind.AVERAGE
        if step <= self.frozen_after():
            return Kind.GRADIENT
        if self._overlap and self._is_sync_step(step):
            if all(p.dtype == torch.float32 for p in state.bucket.params):
                return SYNC
        return None

    def _hyperparameters(self) -> object:
        return _snapshot(self)

    def _early_exchange(
        self, state: FlatState, m: torch.Tensor, errors: dict[str, torch.Tensor], step: int
    ) -> None:
        if step <= self.frozen_after():  # phase A: the gradient at one bit
            self._compress(state, m, errors)
        else:
            _stage_sync(self, state, m, errors, step)


def sync_bucket_(
    opt: Any,
    state: FlatState,
    acc: torch.Tensor,
    m: torch.Tensor,
    p_sync: torch.Tensor,
    lrs: list[float],
    errors: dict[str, torch.Tensor] | None = None,
) -> None:
    """One bucket's sync, in ``step()`` and staged alike: ``acc`` = p′ − p_sync on entry;
    a = C(acc⊙(√v̂ + ε)) ⊙ mask (``errors``: the error buffers to use, default the committed
    ones); m ← −a/s per group (0 where s = 0); acc ← p_sync + a/(√v̂ + ε), each element's move
    bounded by s·B where the step guard applies. Raises NonFiniteError (every rank alike, no
    error buffer changed) if acc is non-finite on any rank."""
    acc.mul_(opt._frozen_denominator(state))
    opt._compress(state, acc, errors)
    opt._mask(state, acc)
    for seg in state.bucket.segments:
        if lrs[seg.group] > 0:
            torch.div(acc[seg.slice], -lrs[seg.group], out=m[seg.slice])
        else:  # η was 0 since the last sync: nothing moved, no momentum to recover
            m[seg.slice].zero_()
    acc.div_(opt._frozen_denominator(state))
    for seg, group in opt.segments(state):  # s lr-weighted steps of at most B each
        where = guarded_elements(opt.config.step_guard, state, seg)
        bound = opt._bound(group) * lrs[seg.group]
        if where is not None and lrs[seg.group] > 0 and math.isfinite(bound):
            bound_step_(acc[seg.slice], bound, where)
    acc.add_(p_sync)


@torch.no_grad()  # (grad mode is per thread: the communication thread's too)
def _stage_sync(
    opt: Any, state: FlatState, m: torch.Tensor, errors: dict[str, torch.Tensor], step: int
) -> None:
    """The bucket's local update and sync for step ``step`` on staged buffers: m′ (folded) →
    m, a staged p′ → p, ``errors`` (staged copies): what ``_phase_b_step`` and ``_sync`` write,
    as they would write it."""
    work = opt.early_work
    st = work._current(state, step)
    gs = opt.global_state
    snapshot = _snapshot(opt)
    entry = not gs["local_started"]
    p = work._buffers.gradient(state)  # the staged p′, then a, then p_sync + a/(√v̂ + ε)
    state.gather_params(p)
    if entry:  # phase B starts: p_sync = p, error feedback starts over
        p_sync = work._buffers.sync_base(state).copy_(p)
        for e in errors.values():
            e.zero_()
    else:
        p_sync = state.flat["p_sync"]
    opt._zero_variance_guard.apply_(state, m, warn=False)
    opt._adam_update(state, m=m, target=p, step=step)
    lrs = list(gs["lrs"]) if not entry else []
    lrs += [0.0] * (len(opt.param_groups) - len(lrs))
    lrs = [s + opt._step_size(g, step) for s, g in zip(lrs, opt.param_groups, strict=True)]
    try:
        sync_bucket_(opt, state, p.sub_(p_sync), m, p_sync, lrs, errors)
    except NonFiniteError:  # on every rank alike: step() returns this bucket to p_sync
        st.sync = (snapshot, True)
        return
    st.sync = (snapshot, False)


def commit_staged_sync(opt: Any, step: int) -> bool:
    """In ``step()``, before ``_phase_b_step`` changes anything: commit the staged sync of step
    ``step`` if the hyperparameters it read are unchanged (buckets not staged yet are staged
    now, in layout order); False: nothing staged, or something changed — the caller runs the
    sync synchronously (the staged work is dropped when ``step()`` ends)."""
    work = opt._early
    if not opt._overlap or work is None or not work.started_any(step):
        return False
    now = _snapshot(opt)
    states = opt.flat_states
    for state in states:
        st = work._current(state, step)
        if st is None:
            continue
        if (st.sync is not None and st.sync[0] != now) or st.seen not in (None, now):
            return False
    for state in states:  # a bucket with gradients missing (or not fp32): completed now
        st = work._current(state, step)
        if st is None:  # (the schedule's step is already ``step``: not ``_staged_for``)
            st = work._staged[id(state)] = StagedWork(step, 0)
        if st.sync is None:
            for i, q in enumerate(state.bucket.params):
                if i not in st.folded:
                    work._fold_one(state, i, q.grad, step)
            st.folded = set(range(len(state.bucket.params)))
            work._exchange(state, st)
    gs = opt.global_state
    entry = not gs["local_started"]
    diverged = False
    for state in states:
        st = work._current(state, step)
        if entry:
            state.reset_comm()
        if st.sync[1]:
            base = work._buffers.sync_base(state) if entry else state.flat["p_sync"]
            state.set_params(base)
            if entry:
                state.buffer("p_sync").copy_(base)
            state.flat["exp_avg"].zero_()
            diverged = True
            continue
        state.set_params(work._buffers.gradient(state))
        state.flat["exp_avg"].copy_(work._buffers.momentum(state))
        work._buffers.swap_errors_into(state)
        state.gather_params(state.buffer("p_sync"))  # p as stored
    if entry:
        gs["lrs"] = [0.0] * len(opt.param_groups)
        gs["local_started"] = True
    if diverged:
        gs["skipped_steps"] += 1
        warn_diverged()
    return True
