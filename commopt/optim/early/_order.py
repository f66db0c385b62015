r"""``overlap=True``: the staged early work's jobs on the communication thread, in a fixed order.

With ``overlap=True`` the staged work of :mod:`commopt.optim.early` starts from per-parameter
gradient hooks instead of DDP, and the averages and exchanges run on the optimizer's
communication thread (:class:`~commopt.optim.early.CommThread`) in a fixed exchange order: each
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

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from commopt.comm import Backend
    from commopt.optim.early._staged import StagedWork
    from commopt.optim.early._thread import CommThread
    from commopt.optim.flat_state import FlatState

__all__ = ["ExchangeSchedule"]


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
