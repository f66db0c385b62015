"""``overlap=True``'s communication thread: one thread per optimizer that runs a step's
collectives in a fixed order beside backward (:class:`CommThread`), and the order the buckets
are exchanged in (:class:`ExchangeSchedule`).

``overlap=True`` (:class:`~commopt.optim._early._work.GradientHooks`) hands each optimizer bucket's
exchange to this thread as soon as the bucket's last gradient has been folded, and backward
goes on on the main thread. The thread is the only place the step's collectives run until
``step()`` has drained it, so the order of collectives on one rank is the order of the thread's
*tickets*, and that order must be the same on every rank (gloo and MPI pair collectives by
their position in each rank's sequence).

Tickets. The main thread reserves a contiguous run of tickets per backward pass (one per
optimizer bucket, numbered by the bucket's position in the exchange order) and fills each with
a job (:meth:`CommThread.submit`) or a no-op (:meth:`CommThread.skip`). The thread runs them
strictly in ticket order: the job of ticket k+1 waits for ticket k even when it was submitted
first. Which tickets get jobs is decided by which buckets complete during backward; that is
the same on every rank when every rank produces gradients for the same parameters (the
documented condition of ``overlap=True``), so every rank issues the same collectives in the
same order whatever the timing.

Errors. A job that raises (a :class:`~commopt.faults.CollectiveError`, say) poisons the
thread: the jobs after it are cancelled, not run, and the error is raised on the main thread by
the next :meth:`~CommThread.wait` or :meth:`~CommThread.wait_all` (``step()`` calls it first
thing), and cleared by :meth:`~CommThread.wait_all`. It is never lost and never leaves the
main thread waiting: a cancelled job still runs its ``cancel`` callback, which completes any
future someone waits on.

CUDA. On a CUDA device a job runs on a side stream of its own: at submission the main thread
records an event on the current stream (the fold's kernels are queued there), the side stream
waits for it before the exchange, and records a second event after it; :meth:`wait_all` makes
the current stream wait for that event, so the optimizer's update is queued after the
exchange without blocking the host. CPU jobs never touch ``torch.cuda``.

Lifetime. The thread is a daemon, started at the first submission, and stopped by
:meth:`close` (called by the optimizer's finalizer, at the latest at interpreter exit), which
joins it: a thread left inside a collective while the interpreter tears down is what aborts a
process at exit (``tests/multirank/test_clean_exit.py``). Between steps it is idle: ``step()``
has drained it.

**The exchange order** (:class:`ExchangeSchedule`): the staged early work's jobs on the
communication thread, in a fixed order.

With ``overlap=True`` the staged work of :mod:`commopt.optim._early` starts from per-parameter
gradient hooks instead of DDP, and the averages and exchanges run on the optimizer's
communication thread (:class:`CommThread`) in a fixed exchange order: each
backward pass is a *round* of tickets, one per bucket at its position in that order, and a
second synced pass before ``step()`` opens a new round (the bucket's earlier job is waited for
before its staged buffers are written again). ``step()`` drains the thread first
(:meth:`ExchangeSchedule.drain`). The thread adds no buffers: only one exchange runs at a time,
with the synchronous exchange's temporaries.

The order starts as the reverse of the layout (backward's usual order) and, after the first
overlapped step, becomes the order in which the buckets completed on rank 0
(:meth:`ExchangeSchedule.fix_order`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from commopt.comm.channels import on_channel, open_channel

if TYPE_CHECKING:
    from commopt.comm import Backend
    from commopt.optim._early import StagedWork
    from commopt.optim.flat_state import FlatState

__all__ = ["CommThread", "ExchangeSchedule"]


#: how long :meth:`CommThread.close` waits for a job in flight before leaving the daemon be
_JOIN_SECONDS = 30.0


class _Job:
    __slots__ = ("cancel", "device", "done_event", "fn", "ready_event")

    def __init__(
        self,
        fn: Callable[[], None] | None,
        cancel: Callable[[BaseException], None] | None,
        device: torch.device | None,
    ) -> None:
        self.fn = fn  # None: a no-op ticket
        self.cancel = cancel
        self.device = device
        self.ready_event: Any = None  # CUDA: recorded on the submitting stream
        self.done_event: Any = None  # CUDA: recorded on the side stream after the job


class CommThread:
    """Runs submitted jobs one at a time in ticket order on a daemon thread (module docstring).

    Args:
        name: the thread's name (shows in stack dumps).
        cuda: the module providing ``Stream``, ``Event``, ``stream`` and ``current_stream``
            (default ``torch.cuda``; tests pass a fake).
    """

    def __init__(self, name: str = "commopt-comm", cuda: Any = None) -> None:
        self.name = name
        #: the communicator channel the jobs' collectives use (None: the backends' own);
        #: :class:`~commopt.optim._early._work.EarlyWork` opens it before the first job
        self.channel: str | None = None
        #: called once by :meth:`close`, after the thread has stopped
        self.on_close: list[Callable[[], None]] = []
        self._cuda = torch.cuda if cuda is None else cuda
        self._cond = threading.Condition()
        self._jobs: dict[int, _Job] = {}  # ticket → job, submitted and not yet run
        self._next = 0  # the next ticket the thread runs
        self._reserved = 0  # tickets [0, _reserved) have been handed out
        self._error: BaseException | None = None  # the first job error since the last wait_all
        self._stop = False
        self._thread: threading.Thread | None = None
        self._streams: dict[torch.device, Any] = {}  # device → side stream (CUDA only)
        self._done_events: list[Any] = []  # CUDA events wait_all makes the current stream wait
        #: seconds the thread has spent running jobs (for profiles: compare with the step time)
        self.busy_seconds = 0.0

    # -- the main thread's side -----------------------------------------------------------------
    @classmethod
    def opened(cls, name: str, backend: Any) -> CommThread:
        """A thread with its own channel on ``backend``, opened now: collectively, while every
        rank builds the optimizer (not at the first job, which a rank that skips that backward
        pass would never reach); :meth:`close` closes its channel too."""
        thread = cls(name)
        thread.channel, closer = open_channel(backend)
        if closer is not None:
            thread.on_close.append(closer)
        return thread

    def reserve(self, count: int) -> int:
        """Hand out ``count`` consecutive tickets; returns the first."""
        with self._cond:
            first = self._reserved
            self._reserved += count
            return first

    def submit(
        self,
        ticket: int,
        fn: Callable[[], None],
        cancel: Callable[[BaseException], None] | None = None,
        device: torch.device | None = None,
    ) -> None:
        """Run ``fn()`` as ticket ``ticket`` once every earlier ticket has run (or ``cancel(err)``
        instead if an earlier job failed with ``err``). ``device``: the tensors' device; a CUDA
        device runs ``fn`` on a side stream after the work queued so far on the current one."""
        job = _Job(fn, cancel, device)
        if device is not None and device.type == "cuda":
            job.ready_event = self._cuda.Event()
            job.ready_event.record(self._cuda.current_stream(device))
            job.done_event = self._cuda.Event()
        self._put(ticket, job)

    def skip(self, ticket: int) -> None:
        """Ticket ``ticket`` runs nothing (its bucket was not completed during backward)."""
        self._put(ticket, _Job(None, None, None))

    def _put(self, ticket: int, job: _Job) -> None:
        with self._cond:
            if not self._next <= ticket < self._reserved or ticket in self._jobs:
                raise RuntimeError(
                    f"CommThread: ticket {ticket} is not open (next {self._next}, reserved "
                    f"up to {self._reserved})"
                )
            self._jobs[ticket] = job
            if job.done_event is not None:
                self._done_events.append((job.device, job.done_event))
            if self._thread is None and job.fn is not None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
        if self._thread is None:  # only no-ops so far: run them here, nothing to wait for
            self._advance_no_ops()

    def _advance_no_ops(self) -> None:
        with self._cond:
            while self._next in self._jobs and self._jobs[self._next].fn is None:
                del self._jobs[self._next]
                self._next += 1
            self._cond.notify_all()

    def wait(self, ticket: int) -> None:
        """Block until ticket ``ticket`` has run; raise the error of a failed job, if any."""
        with self._cond:
            while self._next <= ticket and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise self._error

    def wait_all(self) -> None:
        """Block until every reserved ticket has run, every one of them having been submitted
        or skipped; then make the current CUDA stream wait for the side-stream work. Raises
        (and clears) the error of a job that failed since the last call, after the jobs behind
        it were cancelled."""
        with self._cond:
            while self._next < self._reserved:
                open_tickets = [t for t in range(self._next, self._reserved) if t not in self._jobs]
                if open_tickets:
                    raise RuntimeError(
                        f"CommThread.wait_all: tickets {open_tickets} were never submitted or "
                        "skipped"
                    )
                self._cond.wait()
            error, self._error = self._error, None
            events, self._done_events = self._done_events, []
        for device, event in events:  # the optimizer's update is queued after the exchange
            self._cuda.current_stream(device).wait_event(event)
        if error is not None:
            raise error

    def settle(self) -> None:
        """Block until the thread has run every job it can run now: it stops at the first
        ticket not yet submitted or skipped (never waits for one), or at a failed job."""
        with self._cond:
            while self._next in self._jobs and self._error is None:
                self._cond.wait()

    @property
    def idle(self) -> bool:
        """No ticket is waiting to run."""
        with self._cond:
            return self._next == self._reserved

    def close(self) -> None:
        """Stop the thread (after the job in flight, if any) and join it. Idempotent."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_SECONDS)
        closers, self.on_close = self.on_close, []
        for closer in closers:  # what only the jobs used (the channel), once they are done
            closer()

    # -- the thread's side ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and self._next not in self._jobs:
                    self._cond.wait()
                if self._next not in self._jobs:  # stopped, nothing left to run
                    return
                job = self._jobs[self._next]  # stays listed until it has run
                error = self._error
            if job.fn is not None:
                if error is not None:
                    if job.cancel is not None:
                        job.cancel(error)
                else:
                    start = time.perf_counter()
                    try:
                        with on_channel(self.channel):
                            self._execute(job)
                    except BaseException as err:  # surfaced by wait()/wait_all() on the main thread
                        if job.cancel is not None:
                            job.cancel(err)
                        with self._cond:
                            if self._error is None:
                                self._error = err
                    self.busy_seconds += time.perf_counter() - start
            job = error = None  # hold nothing of the optimizer's while idle
            with self._cond:
                del self._jobs[self._next]
                self._next += 1
                self._cond.notify_all()

    def _execute(self, job: _Job) -> None:
        fn = job.fn
        if fn is None:  # pragma: no cover - _run never passes a no-op
            return
        if job.ready_event is None:
            fn()
            return
        cuda, device = self._cuda, job.device
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = cuda.Stream(device)
        side.wait_event(job.ready_event)
        with cuda.stream(side):
            fn()
        job.done_event.record(side)


class ExchangeSchedule:
    """Rounds of tickets on the communication thread, one per optimizer bucket, in exchange
    order; owns the order and the open round (see the module docstring)."""

    def __init__(self, thread: CommThread | None) -> None:
        self._thread = thread  # the optimizer's (its OS thread starts at the first job)
        self._layout: list[FlatState] = []
        self.round = 0  # backward passes whose tickets were reserved (a round each)
        self._base: int | None = None  # first ticket of the open round (None: none reserved)
        self._ticketed: set[int] = set()  # exchange positions given a job in the open round
        self._position: dict[int, int] = {}  # id(FlatState) → position in the exchange order
        self._order_fixed = False  # the order observed at the first step has been adopted
        self._observed: list[int] = []  # bucket indices in the order they completed (step 1)

    @property
    def thread(self) -> CommThread:
        if self._thread is None:
            raise RuntimeError("ExchangeSchedule: no communication thread (overlap=False)")
        return self._thread

    def new_layout(self, layout: list[FlatState]) -> None:
        """Buckets laid out anew: start over from the reverse layout order."""
        self._layout = layout
        self._set_order(list(reversed(range(len(layout)))))
        self._order_fixed = False
        self._observed.clear()

    def _set_order(self, order: list[int]) -> None:
        """Bucket ``order[k]`` is the k-th to be exchanged (its ticket: the round's first + k)."""
        self._position = {id(self._layout[b]): k for k, b in enumerate(order)}

    def submit(
        self,
        state: FlatState,
        job: Callable[[], None],
        cancel: Callable[[BaseException], None] | None = None,
    ) -> int:
        """Queue the bucket's job at its position of the open round (reserving the round's
        tickets first if none are). Returns the job's ticket."""
        thread = self.thread
        if self._base is None:
            self._base = thread.reserve(len(self._layout))
            self._ticketed.clear()
        position = self._position[id(state)]
        ticket = self._base + position
        self._ticketed.add(position)
        if not self._order_fixed:
            self._observed.append(next(b for b, s in enumerate(self._layout) if s is state))
        thread.submit(ticket, job, cancel, state.bucket.device)
        return ticket

    def wait(self, ticket: int) -> None:
        """Until the job of ``ticket`` has run (raising its error, if it failed)."""
        self.thread.wait(ticket)

    def close_round(self) -> None:
        """No more jobs in the open round: its tickets without one run nothing."""
        if self._base is not None:
            for position in range(len(self._layout)):
                if position not in self._ticketed:
                    self.thread.skip(self._base + position)
            self._base = None
        self.round += 1

    def agree(self, backend: Backend, filler: Callable[[int], None]) -> bool:
        """Before ``step()`` drains: whether every rank started the same exchanges in the open
        round (one all-reduce of a 0/1 mask per position, on the main group, which the thread's
        channel does not use). Where some ranks started an exchange and this rank did not (it
        skipped backward, or left a parameter unused), ``filler(b)`` must queue a job for bucket
        ``b`` that makes the same collectives, so that every rank's thread completes the round
        instead of waiting for a peer forever. Collective; returns True when they differed."""
        n = len(self._layout)
        if backend.world_size == 1 or n == 0:
            return False
        mine = self._ticketed if self._base is not None else set()
        counts = torch.zeros(n, dtype=torch.float32)  # fp32 moves on every backend
        counts[sorted(mine)] = 1.0
        backend.all_reduce(counts, "sum")
        started = [int(c) for c in counts.tolist()]
        if all(c in (0, backend.world_size) for c in started):
            return False
        order = self.exchange_order
        for position, c in enumerate(started):
            if c and position not in mine:
                filler(order[position])
        return True

    def restart(self, st: StagedWork, seen: set[int], i: int) -> None:
        """Before parameter ``i`` goes into the bucket's staged work (overlap): a bucket of an
        earlier backward pass of this step starts over; a parameter seen twice in this pass's
        round means a second synced backward pass, which opens a new round. Either way the
        bucket's job, if any, has to finish first: it reads the staged buffers."""
        if st.round == self.round and i not in seen:
            return
        if st.round == self.round:
            self.close_round()
        if st.ticket is not None:
            self.wait(st.ticket)
        st.reset(self.round)

    def drain(self) -> None:
        """Close the open round and wait until the thread has run all of it; raise the error of
        any job that failed (after cancelling those behind it)."""
        self.close_round()
        self.thread.wait_all()

    def settle(self) -> None:
        """Wait until the thread has run every job it can run now (not those behind a ticket
        still open)."""
        self.thread.settle()

    def fix_order(self, backend: Backend) -> None:
        """After the first overlapped step: exchange buckets in the order they completed,
        rank 0's order on every rank (one broadcast, once), then the rest in reverse layout
        order. Collective; every rank calls it at the same point of ``step()``."""
        if self._order_fixed:
            return
        order = list(dict.fromkeys(self._observed))
        order += [b for b in reversed(range(len(self._layout))) if b not in order]
        if backend.world_size > 1:
            agreed = torch.tensor(order, dtype=torch.float32)  # fp32 moves on every backend
            backend.broadcast(agreed, 0)
            order = [int(b) for b in agreed.tolist()]
        self._set_order(order)
        self._order_fixed = True
        self._observed.clear()

    @property
    def exchange_order(self) -> list[int]:
        """Bucket indices in the order their exchanges run."""
        by_position = sorted((k, id_) for id_, k in self._position.items())
        index = {id(s): b for b, s in enumerate(self._layout)}
        return [index[id_] for _, id_ in by_position]
