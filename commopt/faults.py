"""Fail instead of hanging: a watchdog around any backend's collectives.

A data-parallel job waits in every collective for every rank. When one rank dies or hangs, the
others would wait forever; :func:`watch` makes them stop, with an error that names
the operation, its sequence number and this rank:

- an exception from the wrapped backend (gloo's "Connection closed by peer" when a rank died,
  its "Timed out waiting … ms" when a rank hangs, torch.distributed's own timeout) is re-raised
  as :class:`CollectiveError` naming the collective;
- a collective that has not returned ``timeout`` seconds after it began is handled by a
  background thread, because MPI collectives cannot time out by themselves: on MPI it logs a
  CRITICAL message and calls ``MPI_Abort`` on the communicator, which ends every rank of the
  job (with Open MPI's ``mpiexec``, the launcher exits non-zero); on other backends, whose
  own timeout normally fires first, it does the same with ``os._exit`` after a grace period.

Which rank is at fault: gloo's errors name the peer address; MPI cannot say. Every message
carries the collective's sequence number on this rank (``all_reduce #412``); since all ranks
issue the same collectives in the same order, the rank whose log shows a lower number, or
none, is the one that stopped. ``commopt.init(timeout=...)`` installs the watchdog.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any, TypeVar

import torch

from commopt.comm.base import ReduceOp
from commopt.comm.env import launched_by_mpi

__all__ = [
    "EXIT_CODE",
    "CollectiveError",
    "close_watchdogs",
    "group_timeout",
    "watch",
    "watch_like",
]

B = TypeVar("B")

logger = logging.getLogger(__name__)

#: exit status of a process stopped by the watchdog (``os._exit``, or MPI_Abort's error code)
EXIT_CODE = 70


class CollectiveError(RuntimeError):
    """A collective failed or timed out; ``op``, ``seq`` (this rank's count), ``rank``."""

    def __init__(self, message: str, op: str, seq: int, rank: int) -> None:
        super().__init__(message)
        self.op = op
        self.seq = seq
        self.rank = rank


class _Watched:
    """Mixin placed in front of a backend's class by :func:`watch` (see there)."""

    _wd_timeout: float
    _wd_grace: float
    _wd_mpi_comm: Any
    _wd_lock: threading.Lock
    _wd_current: tuple[str, int, int, float] | None
    _wd_seq: int
    _wd_thread: threading.Thread | None
    _wd_stop: threading.Event
    rank: int
    world_size: int
    name: str

    def arm_watchdog(self, timeout: float, grace: float | None) -> None:
        self._wd_timeout = float(timeout)
        self._wd_mpi_comm = getattr(self, "comm", None) if self.name == "mpi" else None
        if grace is None:
            grace = 0.0 if self._wd_mpi_comm is not None else max(5.0, self._wd_timeout / 2)
        self._wd_grace = float(grace)
        if launched_by_mpi():
            _abort_mpi_job_on_failure()
        if not hasattr(self, "_wd_lock"):
            self._wd_lock = threading.Lock()
            self._wd_current = None  # op, seq, bytes, start
            self._wd_seq = 0
            self._wd_thread = None
            self._wd_stop = threading.Event()
        elif self._wd_stop.is_set() and not (self._wd_thread and self._wd_thread.is_alive()):
            self._wd_stop.clear()  # watched again after close_watchdog(): guard again

    @property
    def watchdog_timeout(self) -> float:
        """Seconds a collective may take before this rank gives up."""
        return self._wd_timeout

    @property
    def watchdog_grace(self) -> float:
        """Extra seconds the backend's own timeout gets before the watchdog ends the process."""
        return self._wd_grace

    # -- the guard -------------------------------------------------------------------------
    def _describe(self, op: str, seq: int, nbytes: int) -> str:
        return (
            f"{op} #{seq} ({nbytes} bytes) on rank {self.rank} of {self.world_size} "
            f"({self.name} backend)"
        )

    def _guarded(self, op: str, nbytes: int, fn: Any, *args: Any) -> Any:
        if self.world_size == 1:
            return fn(*args)
        self._ensure_thread()
        with self._wd_lock:
            self._wd_seq += 1
            seq = self._wd_seq
            start = time.monotonic()
            self._wd_current = (op, seq, nbytes, start)
        try:
            return fn(*args)
        except (ValueError, TypeError):
            raise  # argument errors are the caller's, not the network's
        except Exception as err:
            elapsed = time.monotonic() - start
            _failure_seen(f"{self._describe(op, seq, nbytes)} failed: {type(err).__name__}: {err}")
            raise CollectiveError(
                f"{self._describe(op, seq, nbytes)} failed after {elapsed:.1f} s: {err}. Another "
                "rank has probably died, hung, or issued a different collective; the rank whose "
                "log shows a lower collective number stopped first",
                op,
                seq,
                self.rank,
            ) from err
        finally:
            with self._wd_lock:
                self._wd_current = None

    def _ensure_thread(self) -> None:
        if self._wd_stop.is_set():
            return  # closed: the backend stays usable, unguarded by time
        if self._wd_thread is None or not self._wd_thread.is_alive():
            self._wd_thread = threading.Thread(
                target=self._watch, name="commopt-watchdog", daemon=True
            )
            _register(self)
            self._wd_thread.start()

    def _watch(self) -> None:
        period = min(1.0, self._wd_timeout / 4)
        while not self._wd_stop.wait(period):
            with self._wd_lock:
                current = self._wd_current
            if current is None:
                continue
            op, seq, nbytes, start = current
            elapsed = time.monotonic() - start
            if elapsed < self._wd_timeout + self._wd_grace:
                continue
            with self._wd_lock:
                if self._wd_current is None or self._wd_current[1] != seq:
                    continue  # it finished meanwhile
            self._fire(op, seq, nbytes, elapsed)
            return

    def _fire(self, op: str, seq: int, nbytes: int, elapsed: float) -> None:
        where = (
            "MPI cannot tell which rank is missing"
            if self._wd_mpi_comm is not None
            else "the backend's own timeout did not end it"
        )
        logger.critical(
            "commopt watchdog: %s has not completed after %.1f s (timeout %.1f s): some rank "
            "has died, hung, or issued a different collective; %s — compare the collective "
            "numbers in every rank's log. Ending this job (exit code %d).",
            self._describe(op, seq, nbytes),
            elapsed,
            self._wd_timeout,
            where,
            EXIT_CODE,
        )
        _flush_logs()
        if self._wd_mpi_comm is not None:
            try:
                self._wd_mpi_comm.Abort(EXIT_CODE)
            except Exception:  # pragma: no cover - fall through to the hard exit
                pass
        os._exit(EXIT_CODE)

    # -- collectives -----------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        fn = super().all_reduce  # type: ignore[misc]
        return self._guarded("all_reduce", t.numel() * t.element_size(), fn, t, op)

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        fn = super().all_gather  # type: ignore[misc]
        return self._guarded("all_gather", t.numel() * t.element_size(), fn, out, t)

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        fn = super().all_to_all  # type: ignore[misc]
        return self._guarded("all_to_all", t.numel() * t.element_size(), fn, out, t)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        fn = super().broadcast  # type: ignore[misc]
        return self._guarded("broadcast", t.numel() * t.element_size(), fn, t, src)

    def barrier(self) -> None:
        return self._guarded("barrier", 0, super().barrier)  # type: ignore[misc]

    def close_watchdog(self) -> None:
        """Stop the watchdog thread and wait for it to end (the backend stays usable,
        unguarded by time). :func:`commopt.shutdown` and interpreter exit call it."""
        self._wd_stop.set()
        thread = self._wd_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10.0)


# Every backend whose watchdog thread was started, so that no commopt thread is still running
# when the interpreter finalizes: an ``atexit`` hook (run after the main script, before the
# interpreter tears anything down) stops and joins them all, whether or not the user called
# ``commopt.shutdown()``.
_watched: weakref.WeakSet[_Watched] = weakref.WeakSet()
_atexit_registered = False


def _register(backend: _Watched) -> None:
    global _atexit_registered
    _watched.add(backend)
    if not _atexit_registered:
        atexit.register(close_watchdogs)
        _atexit_registered = True


def close_watchdogs() -> None:
    """Stop and join the watchdog thread of every watched backend in this process."""
    for backend in list(_watched):
        backend.close_watchdog()


# -- a failed rank must not wait in MPI_Finalize ---------------------------------------------------
# Under an MPI launcher mpi4py finalizes MPI when the interpreter exits, and MPI_Finalize waits
# for every rank. A rank that leaves with an error while another is hung (in a collective, or in
# user code) would therefore wait forever, busy, and the launcher with it, even though the error
# was raised in time: the case of gloo bootstrapped over MPI, where gloo's own timeout raises.
# So, under an MPI launcher, a process that saw a collective fail or is ending on an uncaught
# exception calls MPI_Abort at exit, which ends every rank and makes mpiexec exit non-zero.
_failure: str | None = None
_abort_installed = False


def _failure_seen(why: str) -> None:
    global _failure
    if _failure is None:
        _failure = why


def _abort_mpi_job_on_failure() -> None:
    """Install (once) the exit-time MPI_Abort described above."""
    global _abort_installed
    if _abort_installed:
        return
    _abort_installed = True
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        previous(kind, value, tb)
        if not issubclass(kind, KeyboardInterrupt):
            _failure_seen(f"uncaught {kind.__name__}")

    sys.excepthook = excepthook
    atexit.register(_abort_at_exit)


def _abort_at_exit() -> None:
    if _failure is None or "mpi4py.MPI" not in sys.modules:
        return  # nothing failed, or MPI was never initialized (nothing would wait for it)
    mpi = sys.modules["mpi4py.MPI"]
    if not mpi.Is_initialized() or mpi.Is_finalized():
        return
    if mpi.COMM_WORLD.Get_size() == 1:
        return  # a singleton MPI world (mpi4py imported outside a launcher): nobody waits
    logger.critical(
        "commopt: this rank is exiting after a failure (%s); calling MPI_Abort so that the "
        "other ranks and mpiexec end too (exit code %d) instead of waiting in MPI_Finalize",
        _failure,
        EXIT_CODE,
    )
    _flush_logs()
    sys.stdout.flush()
    sys.stderr.flush()
    mpi.COMM_WORLD.Abort(EXIT_CODE)


def _flush_logs() -> None:
    """Flush every log handler before the process is ended from outside Python's shutdown."""
    for handler in logging.getLogger().handlers + logger.handlers:
        try:
            handler.flush()
        except Exception:  # pragma: no cover - a broken handler must not stop the abort
            pass


_SUBCLASSES: dict[type, type] = {}


def watch(backend: B, timeout: float, *, grace: float | None = None) -> B:
    """Guard every collective of ``backend`` by ``timeout`` seconds; returns ``backend`` itself.

    The object keeps its type (``isinstance(watch(TorchBackend(), 60), TorchBackend)``): its
    class is swapped for a subclass whose collectives are guarded. Calling it again changes the
    timeout.

    Args:
        backend: the backend to guard (``TorchBackend``, ``MpiBackend``, ``MixedBackend`` …).
        timeout: seconds a collective may take before this rank gives up. Set it well above
            the longest legitimate wait (a slow rank's checkpoint save, the first step's
            start-up): ranks that are merely slow are indistinguishable from hung ones.
        grace: for backends with their own timeout (torch.distributed), extra seconds to let
            that timeout raise a Python exception before the watchdog ends the process.
            Default ``max(5, timeout/2)``; MPI, which has no timeout of its own, gets none.

    Raises:
        ValueError: ``timeout`` is not a positive number of seconds.
    """
    if not timeout > 0:
        raise ValueError(f"Invalid timeout: {timeout} (must be > 0 seconds)")
    if grace is not None and not grace >= 0:
        raise ValueError(f"Invalid grace: {grace} (must be >= 0 seconds)")
    if not isinstance(backend, _Watched):
        cls = type(backend)
        sub = _SUBCLASSES.get(cls)
        if sub is None:
            sub = type(f"Watched{cls.__name__}", (_Watched, cls), {"__module__": __name__})
            _SUBCLASSES[cls] = sub
        backend.__class__ = sub
    backend.arm_watchdog(timeout, grace)  # type: ignore[attr-defined]
    return backend


def watch_like(parent: object, child: B) -> B:
    """``child`` guarded exactly as ``parent`` is (same timeout and grace); unchanged when
    ``parent`` is not watched.

    For the backends commopt carves out of the user's one (a node's group, the cross-node group,
    a channel): a collective on them must end within the same ``init()`` timeout as one on the
    backend they came from.
    """
    if not isinstance(parent, _Watched) or getattr(child, "world_size", 1) == 1:
        return child
    return watch(child, parent.watchdog_timeout, grace=parent.watchdog_grace)


def group_timeout(backend: object) -> datetime.timedelta | None:
    """The timeout a process group made for ``backend``'s ranks must have: its watchdog's
    (``None``, torch's default, when it is not watched). ``dist.new_group`` does not inherit
    the default group's timeout, so without it gloo would wait its own 30 minutes."""
    if not isinstance(backend, _Watched):
        return None
    return datetime.timedelta(seconds=backend.watchdog_timeout)
