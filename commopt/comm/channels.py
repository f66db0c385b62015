"""Channels: a separate communicator for one thread of collectives.

Collectives on one communicator must be issued in the same order on every rank. An optimizer
with ``overlap=True`` issues its collectives from a communication thread between the end of
backward and ``step()``; if the program issues its own collectives in that window (an
all-reduce of the loss for logging, another optimizer's step), the two interleave differently
on each rank, and gloo aborts, hangs or mixes up messages. So that thread gets a *channel*: a
communicator of its own over the same ranks (``dist.new_group`` of the same ranks, or MPI's
``Dup``), opened collectively, and every collective issued while the channel is active on the
calling thread goes over it; MixedBackend opens it on each backend it routes to. Backends
that cannot open one (a sub-group of torch.distributed, whose ``new_group`` would need every
process; the shared-memory backend) keep using their one communicator: the optimizers refuse
``overlap=True`` on them, and docs/overlap.md says what else that leaves exposed.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Callable, Iterator

__all__ = ["current_channel", "new_channel_name", "on_channel", "open_channel"]

_local = threading.local()
_names = itertools.count()


def new_channel_name() -> str:
    """A fresh channel name. Ranks that open channels in the same order get the same names."""
    return f"commopt-channel-{next(_names)}"


def open_channel(backend: object) -> tuple[str, Callable[[], None] | None]:
    """Open a fresh channel on ``backend`` (collective: every rank in the same order).
    Returns its name and what closes it, or ``("", None)`` when the backend cannot open one
    (its collectives then stay on its one communicator)."""
    name = new_channel_name()
    opener = getattr(backend, "open_channel", None)
    if opener is None or not opener(name):
        return "", None
    closer = getattr(backend, "close_channel", None)
    return name, (None if closer is None else functools.partial(closer, name))


def current_channel() -> str | None:
    """The channel active on this thread (None: the backends' own communicators)."""
    return getattr(_local, "name", None)


@contextlib.contextmanager
def on_channel(name: str | None) -> Iterator[None]:
    """Inside, collectives issued by this thread go over channel ``name`` on every backend that
    has opened it."""
    previous = current_channel()
    _local.name = name
    try:
        yield
    finally:
        _local.name = previous
