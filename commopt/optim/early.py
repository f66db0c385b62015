r"""Work on a bucket that starts before ``step()``, staged until every rank accepts the step.

A DDP communication hook (:mod:`commopt.ddp`) runs while backward is still going, once per DDP
bucket, and can start an optimizer bucket's communication there. But a step may still be
skipped afterwards: a non-finite gradient on any rank skips it on every rank, with every
buffer untouched, and that verdict exists only in ``step()``. So nothing started early may
change the optimizer's state; it is *staged*, and ``step()`` commits or drops it.

Two kinds of early work, named by the algorithm for each bucket and step
(``CompressedOptimizer._early_kind``):

- :data:`AVERAGE`: the step averages the gradient at full precision (1-bit Adam's warmup). The
  hook copies the gradients into a *staged gradient* laid out like the optimizer bucket and
  starts its average as soon as the bucket is complete (:meth:`EarlyWork.average`); the DDP
  bucket receives the averaged values, so they become ``p.grad``, and ``step()`` only has to
  know not to average them again (:meth:`EarlyWork.averaged`). An average of ``p.grad`` is
  nothing ``step()`` could still undo, so nothing else is staged.
- :data:`MOMENTUM`: the step folds this rank's gradient into the momentum and averages the
  momentum at one bit (1-bit Adam's compression stage). The hook computes
  m' = β1·m + (1−β1)·g from the committed m into a *staged momentum* m', and once every
  parameter of the optimizer bucket is folded, runs the compressed exchange on m' with *staged
  error buffers* (copies of e and f). ``step()`` copies m' into m and swaps the staged error
  buffers in (:meth:`EarlyWork.take_momentum`), or drops everything when the step is skipped.
  1-bit LAMB's compression stage is the same fold, its exchange scaled by σ around it
  (``_early_exchange``).
- :data:`GRADIENT`: the step exchanges this rank's gradient at one bit (0/1 Adam's 1-bit
  steps). The hook copies g into the same staged buffer as a momentum and exchanges it once
  the bucket is complete, on staged error buffers; ``step()`` takes the exchanged gradient
  (:meth:`EarlyWork.take_gradient`) and swaps the staged error buffers in.

The exchange always runs on the optimizer's own buckets, never on DDP's: the compressed
average of a buffer depends on its layout (one scale per buffer, server chunks), so working
on the optimizer's layout makes the result bit-identical to the standalone optimizer however
DDP groups the parameters, and keeps the error buffers where they always were (the
optimizer's ``state_dict()``).

With ``overlap=True`` (:mod:`commopt.optim.overlap`) the same staged work starts from
per-parameter gradient hooks instead of DDP, and its averages and exchanges run on the
optimizer's communication thread in a fixed exchange order
(:class:`~commopt.optim.exchange_schedule.ExchangeSchedule`). What is staged, and what it costs
in memory: :mod:`commopt.optim.staged`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from commopt.comm.handoff import device_future
from commopt.compressed import NonFiniteError
from commopt.optim.early_kind import Kind
from commopt.optim.early_reads import EarlyReads
from commopt.optim.exchange_schedule import ExchangeSchedule
from commopt.optim.flat_state import FlatState
from commopt.optim.staged import StagedBuffers, StagedWork
from commopt.optim.staged_fold import fold_param_

if TYPE_CHECKING:
    from commopt.optim.base import CompressedOptimizer
    from commopt.optim.comm_thread import CommThread

__all__ = ["AVERAGE", "GRADIENT", "MOMENTUM", "EarlyWork"]

AVERAGE, MOMENTUM, GRADIENT = Kind.AVERAGE, Kind.MOMENTUM, Kind.GRADIENT


class EarlyWork:
    """The staged early work of one optimizer (see the module docstring)."""

    def __init__(self, optimizer: CompressedOptimizer) -> None:
        self._opt = optimizer
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
        self._schedule = ExchangeSchedule(lambda: optimizer._hooks.thread)

    # -- where a parameter lives ----------------------------------------------------------------
    def locate(self, p: torch.Tensor) -> tuple[FlatState, int] | None:
        """The optimizer bucket holding ``p`` and its index there (None: not this optimizer's)."""
        self._follow_layout()
        return self._where.get(id(p))

    def _follow_layout(self) -> None:
        states = self._opt.flat_states
        if states is not self._layout:  # laid out anew (first use, new group, loaded state)
            self.drain()  # nothing of the old layout may still be in flight
            self._layout = states
            self._schedule.new_layout(states)
            self._where = {
                id(p): (state, i) for state in states for i, p in enumerate(state.bucket.params)
            }
            self._staged.clear()
            self._buffers.clear()

    def next_step(self) -> int:
        """The step the work is for: the optimizer's next ``step()``."""
        return self._opt.global_state["step"] + 1

    def plan(self, params: Sequence[torch.Tensor]) -> list[Kind | None]:
        """Per parameter: :data:`AVERAGE` (average its gradient now: its step does so, or this
        optimizer does not own it, so its owner expects DDP's average), :data:`MOMENTUM`,
        :data:`GRADIENT`, or ``None`` (leave the gradient local: ``step()`` communicates)."""
        step = self.next_step()
        kinds: list[Kind | None] = []
        for p in params:
            where = self.locate(p)
            kind = AVERAGE if where is None else self._opt._early_kind(where[0], step)
            if self.declined and (self._opt._overlap or kind != AVERAGE):
                kind = None  # what it read kept changing after backward: step() does it
            kinds.append(kind)
        return kinds

    def decline(self) -> None:
        """A step's early work was redone because what it read changed after backward (the
        program clips, unscales or changes β1 every step, as a habit): from now on leave it to
        ``step()``, which then communicates once instead of twice. Every rank calls this at the
        same step (the redo is agreed), so every rank's backward starts the same work. Under the
        DDP hook the warmup's averages stay in backward (they are what ``p.grad`` holds)."""
        self.declined = True

    def _staged_for(self, state: FlatState) -> StagedWork:
        step = self.next_step()
        st = self._staged.get(id(state))
        if st is None or st.step != step:
            st = self._staged[id(state)] = StagedWork(step, self._schedule.round)
        return st

    # -- overlap: the communication thread, in a fixed exchange order ---------------------------
    @property
    def _thread(self) -> CommThread:
        return self._schedule.thread

    def _restart(self, st: StagedWork, seen: set[int], i: int) -> None:
        """Before parameter ``i`` goes into the bucket's staged work (overlap): a bucket of an
        earlier backward pass of this step starts over; a parameter seen twice in this pass's
        round means a second synced backward pass, which opens a new round. Either way the
        bucket's job, if any, has to finish first: it reads the staged buffers."""
        schedule = self._schedule
        if st.round == schedule.round and i not in seen:
            return
        if st.round == schedule.round:
            schedule.close_round()
        if st.ticket is not None:
            schedule.wait(st.ticket)
        st.reset(schedule.round)

    def _submit(
        self,
        state: FlatState,
        st: StagedWork,
        job: Callable[[], None],
        cancel: Callable[[BaseException], None] | None = None,
    ) -> None:
        """Queue the bucket's job at its position of the open round, on the thread's own
        channel (opened when the optimizer was built: ``BackwardWork._start_overlap``)."""
        st.ticket = self._schedule.submit(state, job, cancel)

    def drain(self, agree: bool = False) -> None:
        """Close the open round and wait until the communication thread has run all of it;
        raise the error of any job that failed (after cancelling those behind it). Called by
        ``step()`` before it communicates, so its collectives follow the thread's; there
        (``agree``) the ranks first agree that they started the same exchanges, else fill in
        the missing ones and set :attr:`mismatch`: the step is then redone as ``overlap=False``
        would (:meth:`ExchangeSchedule.agree`)."""
        if not self._opt._overlap:
            return
        if agree:
            self._follow_layout()  # even where no backward pass has set it up yet
            if self._schedule.agree(self._opt.backend, self._fill):
                self.mismatch = (
                    "the ranks' backward passes differ (a rank skipped backward or left a "
                    "parameter unused)"
                )
        self._schedule.drain()

    def _fill(self, b: int) -> None:
        """Queue, for bucket ``b``, the job the other ranks ran (its kind's collectives) on
        zeroed staged buffers; whatever it computes is dropped with the redone step."""
        state = (self._layout or [])[b]
        st = self._staged_for(state)
        if self._opt._early_kind(state, st.step) == AVERAGE:
            st.arrived.clear()
            self._buffers.gradient(state).zero_()
            st.future = device_future(state.bucket.device)
            self._start_average(state, st, threaded=True)
            return
        self._buffers.momentum(state).zero_()
        st.seen = self._opt._hyperparameters()
        self._submit(state, st, functools.partial(self._exchange, state, st))

    def settle(self) -> None:
        """Wait until the thread has run every job it can run now (not those behind a ticket
        still open) — for reading counters mid-step."""
        if self._opt._overlap:
            self._schedule.settle()

    def fix_order(self) -> None:
        """After the first overlapped step: exchange buckets in the order they completed,
        rank 0's order on every rank (one broadcast, once), then the rest in reverse layout
        order. Collective; every rank calls it from ``step()`` after the same-model check."""
        if self._opt._overlap and self._layout is not None:
            self._schedule.fix_order(self._opt.backend)

    @property
    def exchange_order(self) -> list[int]:
        """Bucket indices in the order their exchanges run (overlap)."""
        return self._schedule.exchange_order

    def _current(self, state: FlatState, step: int) -> StagedWork | None:
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
                self._restart(st, st.arrived, i)
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
                self.reads.note(p, g, st.step, self._opt.param_groups)
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
            ready = len(st.arrived) == len(state.bucket.params)
            if st.future is not None and not st.future.done() and not st.averaged:
                if ready or last:
                    self._start_average(state, st, threaded)
        return [(st.future, spans) for _, st, spans in touched.values()]  # type: ignore[misc]

    def _start_average(self, state: FlatState, st: StagedWork, threaded: bool = False) -> None:
        from commopt.comm import all_reduce_async  # no import cycle at module load

        buf = self._buffers.gradient(state)
        for i, p in enumerate(state.bucket.params):
            if i not in st.arrived:  # not in the DDP model: zero here, averaged by step()
                start = state.bucket.offsets[i]
                buf[start : start + p.numel()].zero_()
        st.averaged = set(st.arrived)
        placeholder = st.future
        if placeholder is None:  # pragma: no cover - average() always sets it first
            raise RuntimeError("EarlyWork: no future to complete")
        backend = self._opt.backend
        if backend.world_size > 1:
            self._opt._rounds["full"] += 1
        if threaded:  # on the thread, in order; the same arithmetic as below

            def job() -> None:
                placeholder.set_result(all_reduce_async(backend, buf, "avg").wait())

            self._submit(state, st, job, placeholder.set_exception)
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
            if self._opt._early_kind(state, st.step) == MOMENTUM:
                self._buffers.drop_gradient(state)  # no later step averages this bucket again
            if threaded:
                self._restart(st, st.folded, i)
            elif i in st.folded:  # a second synced backward before step(): start the bucket over
                st.folded.clear()
                st.exchanged = st.failed = False
            self._fold_one(state, i, g, st.step)
            if threaded and g is not None:
                self.reads.note(p, g, st.step, self._opt.param_groups)
            elif g is not None:  # the DDP hook: p.grad is written when backward ends
                self.reads.expect(p, st.step, self._opt.param_groups)
            st.folded.add(i)
            if len(st.folded) == len(state.bucket.params):
                complete.append((state, st))
        for state, st in complete:
            if threaded:
                st.seen = self._opt._hyperparameters()  # on the main thread, during backward
                self._submit(state, st, functools.partial(self._exchange, state, st))
            else:
                self._exchange(state, st)

    def _fold_one(self, state: FlatState, i: int, g: torch.Tensor | None, step: int) -> None:
        """One parameter into the staged momentum, as ``step()`` would (:mod:`.staged_fold`)."""
        gradient = self._opt._early_kind(state, step) == GRADIENT
        fold_param_(self._opt, state, i, g, self._buffers.momentum(state), gradient)

    def _exchange(self, state: FlatState, st: StagedWork) -> None:
        errors = self._buffers.errors_from(state)
        try:
            self._opt._early_exchange(state, self._buffers.momentum(state), errors, st.step)
        except NonFiniteError:  # raised on every rank alike: the step will be skipped
            st.failed = True
        st.exchanged = True

    # -- step()'s side --------------------------------------------------------------------------
    def averaged(self, state: FlatState, step: int) -> set[int]:
        """Indices of the bucket's parameters whose gradient is already the average (step
        ``step``)."""
        st = self._current(state, step)
        return st.averaged if st is not None else set()

    def failed(self, step: int) -> bool:
        """Whether an early exchange for step ``step`` found non-finite values (on every rank
        alike): the step must be skipped."""
        return any(st.failed for st in self._staged.values() if st.step == step)

    def started_any(self, step: int) -> bool:
        """Whether gradients were used before ``step()`` for step ``step``: folded into a
        staged momentum (DDP hook or overlap), or averaged into a staged gradient that
        ``step()`` reads instead of ``p.grad`` (overlap)."""
        overlap = self._opt._overlap
        return any(
            st.folded or (overlap and st.averaged)
            for st in self._staged.values()
            if st.step == step
        )

    def averaged_gradient(self, state: FlatState, step: int) -> torch.Tensor | None:
        """The bucket's staged gradient once its average is complete (waited for), if every
        parameter's gradient went into it; else None."""
        st = self._current(state, step)
        if st is None or len(st.averaged) != len(state.bucket.params) or st.future is None:
            return None
        st.future.wait()
        return self._buffers.gradient(state)

    def take_momentum(self, state: FlatState, step: int) -> bool:
        """Commit the bucket's exchanged momentum for step ``step`` into ``exp_avg`` and its
        staged error buffers into the exchange state; False when no momentum was started early
        (the algorithm then does the whole thing itself). A bucket only partly folded (some of
        its parameters are not in the DDP model) is completed first, from ``p.grad``."""
        m = self._take(state, step)
        if m is None:
            return False
        state.flat["exp_avg"].copy_(m)
        return True

    def take_gradient(self, state: FlatState, step: int) -> torch.Tensor | None:
        """:data:`GRADIENT`: the bucket's gradient exchanged at one bit for step ``step`` (a
        staged buffer, the algorithm's until the next backward), its staged error buffers
        committed; None when nothing was started early. Completed first like
        :meth:`take_momentum`."""
        return self._take(state, step)

    def _take(self, state: FlatState, step: int) -> torch.Tensor | None:
        st = self._current(state, step)
        if st is None or not st.folded:
            return None
        if not st.exchanged:
            for i, p in enumerate(state.bucket.params):
                if i not in st.folded:
                    self._fold_one(state, i, p.grad, step)
            self._exchange(state, st)
        if st.failed:
            raise NonFiniteError([])
        self._buffers.swap_errors_into(state)
        del self._staged[id(state)]
        return self._buffers.momentum(state)

    def clear(self) -> None:
        """Drop all staged work and what it read (the step was taken or skipped, the state was
        reloaded, or what the work read changed: ``step()`` then runs as ``overlap=False``
        would), once every average in flight has completed (their buffers are reused)."""
        for st in self._staged.values():
            if st.averaged and st.future is not None:
                with contextlib.suppress(Exception):  # a failed average was raised already
                    st.future.wait()
        self._staged.clear()
        self.reads.clear()
        self.mismatch = None
