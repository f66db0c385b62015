"""The staged early work of one optimizer (overview: :mod:`commopt.optim._early`).

**What it read** (:class:`EarlyReads`): what ``overlap=True``'s early work read during backward,
so that ``step()`` can tell whether it still holds (docs/overlap.md, "Changing gradients or β1
after backward").

The early work consumes each gradient as soon as backward produces it, and β1 with it. Between
backward and ``step()`` a program may clip or unscale ``p.grad`` in place, replace it, or let a
scheduler change β1. A gradient tensor's ``_version`` moves with every in-place write, so
keeping (tensor, version) per parameter and the groups' β1 is enough to tell.

Under the DDP hook the work reads DDP's bucket, not ``p.grad``; DDP copies the bucket into
``p.grad`` only when backward ends. So the hook marks the parameter (:meth:`EarlyReads.expect`)
and :meth:`EarlyReads.after_backward` records ``p.grad`` and its version once DDP has written
it (:func:`after_ddp_backward`).

**Gradient hooks**: a bucket's communication runs during backward, on a communication thread.

As soon as a parameter's gradient is accumulated (``Tensor.register_post_accumulate_grad_hook``)
its part of the step's early work starts on the main thread: the gradient is copied into the
warmup's staged gradient, or folded into a staged momentum (:class:`EarlyWork`, shared with the
DDP hook). Once an optimizer bucket is complete, its collective work — the warmup's
full-precision average, or the compression stage's 1-bit exchange — is queued on the optimizer's
:class:`~commopt.optim._early._thread.CommThread`, which runs it while backward goes on. The
thread runs buckets strictly in the *exchange order* (reverse layout order at first, since
gradients become ready from the last layer back; from the second step on, the order in which
rank 0 saw them complete at the first step), so every rank issues the same collectives in the
same order. ``step()`` first drains the thread (raising any error of its jobs), then agrees on
the gradients and commits the staged work, or drops it if the step is skipped.

The hooks own their handles and two switches; the staged work belongs to the optimizer's
:class:`EarlyWork`, which they reach through the getter they are
given (a loaded state dict builds the early work anew).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from commopt.comm import all_reduce_async
from commopt.comm.handoff import device_future
from commopt.compressed import NonFiniteError
from commopt.join import in_backward
from commopt.optim._early import EarlyPlan, Kind, StagedBuffers, StagedWork, fold_param_
from commopt.optim._early._thread import ExchangeSchedule
from commopt.optim.flat_state import FlatState

if TYPE_CHECKING:
    from commopt.optim._communication import Communication
    from commopt.optim._early._thread import CommThread

__all__ = ["EarlyReads", "EarlyWork", "GradientHooks", "after_ddp_backward"]


class EarlyWork:
    """The staged early work of one optimizer (see the module docstring)."""

    def __init__(
        self,
        layout: Callable[[], list[FlatState]],
        groups: Callable[[], list[dict[str, Any]]],
        next_step: Callable[[], int],
        comm: Communication,
        plan: EarlyPlan,
        thread: CommThread | None = None,
    ) -> None:
        """``layout``, ``groups``, ``next_step``: the optimizer's buckets, param groups and next
        step, as they are now; ``comm``: its backend and round counters; ``plan``: its
        algorithm's side; ``thread`` (``overlap=True``): where the collectives run, in
        exchange order (None: they run where the work starts: the DDP hook)."""
        self._states_of, self._groups_of, self._next_step = layout, groups, next_step
        self._comm, self._plan = comm, plan
        #: overlap: the work starts from gradient hooks, its collectives on ``thread``
        self.threaded = thread is not None
        self._layout: list[FlatState] | None = None
        self._where: dict[int, tuple[FlatState, int]] = {}  # id(param) → (bucket, index)
        self._staged: dict[int, StagedWork] = {}  # id(FlatState) → this step's work
        self._buffers = StagedBuffers()  # what the work writes, kept from step to step
        #: overlap: what the work read during backward, which step() checks is unchanged
        self.reads = EarlyReads()
        #: overlap: why the ranks' early work differed this step (None: it did not)
        self.mismatch: str | None = None
        #: the work is left to step() (:meth:`decline`)
        self.declined = False
        # overlap=True: the jobs on the communication thread, in exchange order
        self._schedule = ExchangeSchedule(thread)

    # -- where a parameter lives ----------------------------------------------------------------
    def locate(self, p: torch.Tensor) -> tuple[FlatState, int] | None:
        """The optimizer bucket holding ``p`` and its index there (None: not this optimizer's)."""
        self._follow_layout()
        return self._where.get(id(p))

    def _follow_layout(self) -> None:
        states = self._states_of()
        if states is not self._layout:  # laid out anew (first use, new group, loaded state)
            self.drain()  # nothing of the old layout may still be in flight
            self._layout = states
            self._schedule.new_layout(states)
            self._where = {
                id(p): (state, i) for state in states for i, p in enumerate(state.bucket.params)
            }
            self._staged.clear()
            self._buffers.clear()

    def plan(self, params: Sequence[torch.Tensor]) -> list[Kind | None]:
        """Per parameter: :data:`AVERAGE` (average its gradient now: its step does so, or this
        optimizer does not own it, so its owner expects DDP's average), :data:`MOMENTUM`,
        :data:`GRADIENT`, or ``None`` (leave the gradient local: ``step()`` communicates)."""
        step = self._next_step()
        kinds: list[Kind | None] = []
        for p in params:
            where = self.locate(p)
            kind = Kind.AVERAGE if where is None else self._plan.kind(where[0], step)
            if self.declined and (self.threaded or kind != Kind.AVERAGE):
                kind = None  # what it read kept changing after backward: step() does it
            kinds.append(kind)
        return kinds

    def decline(self) -> None:
        """From now on leave the work to ``step()``, which then communicates once, not twice: what
        the work read kept changing after backward (clipping, unscaling, a β1 schedule). Every
        rank calls it at the same (agreed) step. Under the DDP hook the warmup's averages stay in
        backward (they are what ``p.grad`` holds)."""
        self.declined = True

    def _staged_for(self, state: FlatState) -> StagedWork:
        step = self._next_step()
        st = self._staged.get(id(state))
        if st is None or st.step != step:
            st = self._staged[id(state)] = StagedWork(step, self._schedule.round)
        return st

    # -- overlap: the communication thread, in a fixed exchange order ---------------------------
    @property
    def thread(self) -> CommThread:
        """The communication thread the collectives run on (``overlap=True``)."""
        return self._schedule.thread

    def drain(self, agree: bool = False) -> None:
        """Close the open round, wait until the thread has run all of it, and raise the error of
        any job that failed (those behind it cancelled). ``step()`` calls it before it
        communicates, with ``agree``: the ranks first agree that they started the same
        exchanges, else fill in the missing ones and set :attr:`mismatch`, and the step is redone
        as ``overlap=False`` would (:meth:`ExchangeSchedule.agree`)."""
        if not self.threaded:
            return
        if agree:
            self._follow_layout()  # even where no backward pass has set it up yet
            if self._schedule.agree(self._comm.backend, self._fill):
                self.mismatch = (
                    "the ranks' backward passes differ (a rank skipped backward or left a "
                    "parameter unused)"
                )
        self._schedule.drain()

    def _fill(self, b: int) -> None:
        """Queue bucket ``b``'s job that other ranks ran, on zeroed buffers (its result is
        dropped with the redone step)."""
        state = (self._layout or [])[b]
        st = self._staged_for(state)
        if self._plan.kind(state, st.step) == Kind.AVERAGE:
            st.arrived.clear()
            self._buffers.gradient(state).zero_()
            st.future = device_future(state.bucket.device)
            self._start_average(state, st, threaded=True)
            return
        self._buffers.momentum(state).zero_()
        st.seen = self._plan.snapshot()
        st.ticket = self._schedule.submit(state, functools.partial(self._exchange, state, st))

    def settle(self) -> None:
        """Wait until the thread has run every job it can run now (for counters mid-step)."""
        if self.threaded:
            self._schedule.settle()

    def fix_order(self) -> None:
        """After the first overlapped step: exchange buckets in the order they completed,
        rank 0's order on every rank (one broadcast, once), then the rest in reverse layout
        order. Collective; every rank calls it from ``step()`` after the same-model check."""
        if self.threaded and self._layout is not None:
            self._schedule.fix_order(self._comm.backend)

    @property
    def exchange_order(self) -> list[int]:
        """Bucket indices in the order their exchanges run (overlap)."""
        return self._schedule.exchange_order

    def current(self, state: FlatState, step: int) -> StagedWork | None:
        """The bucket's staged work for ``step``, if any."""
        st = self._staged.get(id(state))
        return st if st is not None and st.step == step else None

    # -- the hook's side ------------------------------------------------------------------------
    def average(
        self,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        last: bool,
        threaded: bool = False,
    ) -> list[tuple[torch.futures.Future[torch.Tensor], list[tuple[int, int, int]]]]:
        """Copy this rank's gradients of ``params`` into the staged gradient of their optimizer
        buckets; start the full-precision average of every bucket that is now complete (and,
        when ``last`` — DDP's last bucket of this backward — of every bucket started, its
        missing parameters as zeros: they stay for ``step()`` to average). Collective, like
        :meth:`fold`. Returns, per optimizer bucket touched, a future of its averaged staged
        gradient and ``(k, start, numel)`` for each of ``params`` in it (k: position in
        ``params``, start: offset in the bucket). ``threaded`` (overlap): the averages run on
        the communication thread, in exchange order."""
        touched: dict[int, tuple[FlatState, StagedWork, list[tuple[int, int, int]]]] = {}
        for k, (p, g) in enumerate(zip(params, grads, strict=True)):
            where = self.locate(p)
            if where is None:
                raise RuntimeError("average: the parameter does not belong to this optimizer")
            state, i = where
            st = self._staged_for(state)
            if threaded:
                self._schedule.restart(st, st.arrived, i)
            elif i in st.arrived:  # a second synced backward before step(): start it over
                if st.averaged and st.future is not None:
                    st.future.wait()  # never overwrite a buffer a collective is still reading
                st.arrived.clear()
                st.averaged.clear()
                st.future = None
            if st.future is None:  # completed on the stream that averaged (comm.handoff)
                st.future = device_future(state.bucket.device)
            buf = self._buffers.gradient(state)
            start, numel = state.bucket.offsets[i], p.numel()
            buf[start : start + numel].copy_(g.reshape(-1))
            if threaded:
                self.reads.note(p, g, st.step, self._groups_of())
            st.arrived.add(i)
            touched.setdefault(id(state), (state, st, []))[2].append((k, start, numel))
        starting = [(s, st) for s, st, _ in touched.values()]
        if last:  # nothing more arrives in this backward: start what has begun
            starting += [
                (s, self._staged[id(s)])
                for s in self._layout or []
                if id(s) in self._staged and id(s) not in touched
            ]
        for state, st in starting:
            ready = last or len(st.arrived) == len(state.bucket.params)
            if ready and st.future is not None and not st.future.done() and not st.averaged:
                self._start_average(state, st, threaded)
        return [(st.future, spans) for _, st, spans in touched.values()]  # type: ignore[misc]

    def _start_average(self, state: FlatState, st: StagedWork, threaded: bool = False) -> None:
        buf = self._buffers.gradient(state)
        for i, p in enumerate(state.bucket.params):
            if i not in st.arrived:  # not in the DDP model: zero here, averaged by step()
                start = state.bucket.offsets[i]
                buf[start : start + p.numel()].zero_()
        st.averaged = set(st.arrived)
        placeholder = st.future
        if placeholder is None:  # pragma: no cover - average() always sets it first
            raise RuntimeError("EarlyWork: no future to complete")
        backend = self._comm.backend
        if backend.world_size > 1:
            self._comm.count_average()
        if threaded:  # on the thread, in order; the same arithmetic as below

            def job() -> None:
                placeholder.set_result(all_reduce_async(backend, buf, "avg").wait())

            st.ticket = self._schedule.submit(state, job, placeholder.set_exception)
            return
        started = all_reduce_async(backend, buf, "avg")

        def done(fut: torch.futures.Future[torch.Tensor]) -> None:
            try:  # (inside a done callback torch has ordered this stream after ``fut``)
                placeholder.set_result(fut.wait())
            except Exception as err:  # DDP waits on the placeholder: never leave it pending
                placeholder.set_exception(err)

        started.add_done_callback(done)

    def fold(
        self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], threaded: bool = False
    ) -> None:
        """m' ← β1·m + (1−β1)·g into the staged momentum, g being this rank's gradient of each
        parameter (:data:`GRADIENT` steps: g itself); every optimizer bucket whose parameters
        are now all folded is exchanged at once. Collective: every rank folds the same
        parameters in the same order (DDP calls its hook bucket by bucket in the same order
        everywhere). ``threaded`` (overlap): the exchanges run on the communication thread, in
        exchange order."""
        complete: list[tuple[FlatState, StagedWork]] = []
        for p, g in zip(params, grads, strict=True):
            where = self.locate(p)
            if where is None:
                raise RuntimeError("fold: the parameter does not belong to this optimizer")
            state, i = where
            st = self._staged_for(state)
            if self._plan.kind(state, st.step) == Kind.MOMENTUM:
                self._buffers.drop_gradient(state)  # no later step averages this bucket again
            if threaded:
                self._schedule.restart(st, st.folded, i)
            elif i in st.folded:  # a second synced backward before step(): start the bucket over
                st.folded.clear()
                st.exchanged = st.failed = False
            self._fold_one(state, i, g, st.step)
            if threaded and g is not None:
                self.reads.note(p, g, st.step, self._groups_of())
            elif g is not None:  # the DDP hook: p.grad is written when backward ends
                self.reads.expect(p, st.step, self._groups_of())
            st.folded.add(i)
            if len(st.folded) == len(state.bucket.params):
                complete.append((state, st))
        for state, st in complete:
            if threaded:
                st.seen = self._plan.snapshot()  # on the main thread, during backward
                st.ticket = self._schedule.submit(
                    state, functools.partial(self._exchange, state, st)
                )
            else:
                self._exchange(state, st)

    def _fold_one(self, state: FlatState, i: int, g: torch.Tensor | None, step: int) -> None:
        """One parameter into the staged momentum, as ``step()`` would (:func:`fold_param_`)."""
        gradient = self._plan.kind(state, step) == Kind.GRADIENT
        staged, missing_as_zero = self._buffers.momentum(state), self._plan.fold_missing_as_zero
        fold_param_(state, i, g, staged, self._groups_of(), gradient, missing_as_zero)

    def _exchange(self, state: FlatState, st: StagedWork) -> None:
        errors = self._buffers.errors_from(state)
        try:
            m = self._buffers.momentum(state)
            st.outcome = self._plan.exchange(state, m, errors, st.step, self._buffers)
        except NonFiniteError:  # raised on every rank alike: the step will be skipped
            st.failed = True
        st.exchanged = True

    # -- step()'s side --------------------------------------------------------------------------
    def averaged(self, state: FlatState, step: int) -> set[int]:
        """Indices of the bucket's parameters whose gradient is already averaged (``step``)."""
        st = self.current(state, step)
        return st.averaged if st is not None else set()

    def failed(self, step: int) -> bool:
        """Whether an early exchange for ``step`` found non-finite values (on every rank
        alike): the step must be skipped."""
        return any(st.failed for st in self._staged.values() if st.step == step)

    def started_any(self, step: int) -> bool:
        """Whether gradients were used before ``step()`` for step ``step``: folded into a
        staged momentum (DDP hook or overlap), or averaged into a staged gradient that
        ``step()`` reads instead of ``p.grad`` (overlap)."""
        this_step = [st for st in self._staged.values() if st.step == step]
        return any(st.folded or (self.threaded and st.averaged) for st in this_step)

    def averaged_grads(self, state: FlatState, step: int, out: torch.Tensor) -> torch.Tensor:
        """``out`` ← the bucket's gradients averaged over all ranks at full precision, flat:
        the staged average where overlap made one of all of them (waited for), else from
        ``p.grad``, averaging only those a DDP hook has not averaged already."""
        st = self.current(state, step)
        every = st is not None and len(st.averaged) == len(state.bucket.params)
        if self.threaded and every and st.future is not None:  # p.grad is local
            st.future.wait()
            return out.copy_(self._buffers.gradient(state))
        state.gather_grads(out)
        done = self.averaged(state, step)
        if len(done) == len(state.bucket.params):
            return out
        self._comm.average(out)
        for i in done:  # a bucket partly outside the DDP model: restore what was averaged
            p, start = state.bucket.params[i], state.bucket.offsets[i]
            if p.grad is None:  # (set to None after backward: 0, as gather_grads)
                out[start : start + p.numel()].zero_()
            else:
                out[start : start + p.numel()].copy_(p.grad.reshape(-1))
        return out

    def take_momentum(self, state: FlatState, step: int) -> bool:
        """Commit the bucket's exchanged momentum for step ``step`` into ``exp_avg``, its staged
        error buffers into the exchange state (a bucket partly outside the DDP model completed
        first, from ``p.grad``); False: nothing started early, the algorithm does it all."""
        m = self._take(state, step)
        if m is not None:
            state.flat["exp_avg"].copy_(m)
        return m is not None

    def take_gradient(self, state: FlatState, step: int) -> torch.Tensor | None:
        """:data:`GRADIENT`: the bucket's 1-bit exchanged gradient (a staged buffer, the
        algorithm's until the next backward), as :meth:`take_momentum` (None: none started)."""
        return self._take(state, step)

    @property
    def buffers(self) -> StagedBuffers:
        """What the work (and a plan's exchange) writes, per bucket."""
        return self._buffers

    def complete(self, state: FlatState, step: int) -> StagedWork:
        """The bucket's work for step ``step``, finished inside ``step()`` where backward left
        it incomplete: the parameters not folded yet are folded from ``p.grad``, and the
        plan's exchange runs (0/1 Adam's staged syncs, in layout order)."""
        st = self.current(state, step)
        if st is None:  # (the optimizer's step is already ``step``: not ``_staged_for``)
            st = self._staged[id(state)] = StagedWork(step, 0)
        if not st.exchanged:
            for i, p in enumerate(state.bucket.params):
                if i not in st.folded:
                    self._fold_one(state, i, p.grad, step)
            st.folded = set(range(len(state.bucket.params)))
            self._exchange(state, st)
        return st

    def _take(self, state: FlatState, step: int) -> torch.Tensor | None:
        st = self.current(state, step)
        if st is None or not st.folded:
            return None
        self.complete(state, step)
        if st.failed:
            raise NonFiniteError([])
        self._buffers.swap_errors_into(state)
        del self._staged[id(state)]
        return self._buffers.momentum(state)

    def clear(self) -> None:
        """Drop all staged work and what it read (step taken or skipped, state reloaded, or
        what the work read changed: ``step()`` then runs as ``overlap=False`` would), once every
        average in flight has completed (their buffers are reused)."""
        for st in self._staged.values():
            if st.averaged and st.future is not None:
                with contextlib.suppress(Exception):  # a failed average was raised already
                    st.future.wait()
        self._staged.clear()
        self.reads.clear()
        self.mismatch = None


def after_ddp_backward(fn: Callable[[], None]) -> bool:
    """Run ``fn`` at the end of the current backward pass, after DDP has written ``p.grad``;
    whether it was queued.

    Called from a DDP communication hook. DDP queues its ``finalize_backward`` on the autograd
    engine while backward runs; a callback queued then runs before it, but one queued *by* such
    a callback runs after every callback queued during backward, DDP's included. Outside a
    backward pass (a joined rank, where DDP's join hook shadows one: :mod:`commopt.join`) DDP
    writes no ``p.grad``, and there is nothing to run after it.
    """
    if not in_backward():
        return False
    engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
    engine.queue_callback(lambda: engine.queue_callback(fn))
    return True


class EarlyReads:
    """The gradients (tensor and version) and β1 values one step's early work read."""

    def __init__(self) -> None:
        self._grads: dict[int, tuple[torch.Tensor, int]] = {}  # id(param) → (grad, version)
        self._betas: tuple[float, ...] = ()
        self._step = 0
        self._expected: list[torch.Tensor] = []  # DDP hook: p.grad not written yet

    def note(
        self, p: torch.Tensor, g: torch.Tensor, step: int, groups: Sequence[dict[str, Any]]
    ) -> None:
        """The work of step ``step`` read ``g`` as ``p``'s gradient (β1 is taken at the first
        read of the step)."""
        self._begin(step, groups)
        self._grads[id(p)] = (g, g._version)

    def expect(self, p: torch.Tensor, step: int, groups: Sequence[dict[str, Any]]) -> None:
        """The DDP hook folded ``p``'s gradient for step ``step``; its ``p.grad`` is recorded
        at the end of backward (:meth:`after_backward`)."""
        self._begin(step, groups)
        if not self._expected and not after_ddp_backward(self.after_backward):
            return  # no backward: a joined rank's (commopt.join), whose p.grad DDP leaves
        self._expected.append(p)

    def _begin(self, step: int, groups: Sequence[dict[str, Any]]) -> None:
        """A read for step ``step``: the first of the step forgets the previous step's reads
        and takes the groups' β1."""
        if self._step != step:
            self.clear()
            self._step = step
            self._betas = tuple(group["betas"][0] for group in groups)

    def after_backward(self) -> None:
        """Record ``p.grad`` and its version for every parameter :meth:`expect` named."""
        for p in self._expected:
            if p.grad is not None:
                self._grads[id(p)] = (p.grad, p.grad._version)
        self._expected.clear()

    def stale(self, step: int, groups: Sequence[dict[str, Any]]) -> str | None:
        """Why what step ``step``'s work read no longer holds on this rank, or None."""
        if self._step != step or not self._grads:
            return None
        betas = tuple(group["betas"][0] for group in groups)
        if betas[: len(self._betas)] != self._betas:
            return "a param group's beta1 changed after backward"
        params = {id(p): p for group in groups for p in group["params"]}
        for key, (g, version) in self._grads.items():
            p = params.get(key)
            if p is None or p.grad is not g or g._version != version:
                return "a gradient changed after backward (e.g. clip_grad_norm_)"
        return None

    def clear(self) -> None:
        self._grads.clear()
        self._expected.clear()


#: each parameter's gradient hook belongs to the newest overlap=True optimizer built over it
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


class GradientHooks:
    """The per-parameter gradient hooks of one optimizer (``overlap=True``).

    A parameter's hook belongs to the newest such optimizer built over it: building one takes
    the parameter's hook from an older one (a new optimizer per phase of training). The older
    one may still be alive on some ranks and collected on others, as garbage collection finds
    it; if its hook still fired, its thread would start an exchange on some ranks only, and the
    ranks would hang or mix up messages. Taken at construction, the same on every rank, it
    starts nothing more (stepped anyway, it steps as ``overlap=False`` would).
    """

    def __init__(self, work: Callable[[], EarlyWork]) -> None:
        self._work = work
        #: hooks were requested (``overlap=True``)
        self.enabled = False
        #: inside ``no_sync()``: a backward pass starts nothing
        self.paused = False
        self._handles: dict[int, Any] = {}  # id(parameter) → its hook's handle

    def enable(self, params: Sequence[torch.Tensor]) -> None:
        self.enabled = True
        self.attach(params)

    def attach(self, params: Sequence[torch.Tensor]) -> None:
        # The parameters outlive an optimizer often enough (a new optimizer per phase): the hook
        # holds it weakly, so a dropped optimizer is collected and its thread stopped.
        ref = weakref.WeakMethod(self._ready)

        def ready(p: torch.Tensor) -> None:
            method = ref()
            if method is not None:
                method(p)

        for p in params:
            if p.requires_grad:
                older = _OWNERS.get(p)
                owner = older() if older is not None else None
                if owner is not None and owner is not self:
                    owner.release(p)
                self._handles[id(p)] = p.register_post_accumulate_grad_hook(ready)
                _OWNERS[p] = weakref.ref(self)

    def release(self, p: torch.Tensor) -> None:
        """Remove the hook on ``p`` (a newer optimizer over ``p`` takes it)."""
        handle = self._handles.pop(id(p), None)
        if handle is not None:
            handle.remove()

    @torch.no_grad()
    def _ready(self, p: torch.Tensor) -> None:
        if self.paused or p.grad is None or p.grad.is_sparse:
            return
        work = self._work()
        kind = work.plan([p])[0]
        if kind == Kind.AVERAGE and work.locate(p) is not None:
            work.average([p], [p.grad], last=False, threaded=True)
        elif kind in (Kind.MOMENTUM, Kind.GRADIENT, Kind.SYNC):
            work.fold([p], [p.grad], threaded=True)
