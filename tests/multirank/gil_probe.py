"""Does a thread waiting in a collective let the main thread run Python? (a helper for tests)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["poll_during"]


def poll_during(communicate: Callable[[], object]) -> tuple[float, int]:
    """Run ``communicate`` in a worker thread while this thread spins on Python code.

    Returns (seconds the worker spent in ``communicate``, how many of this thread's loop
    iterations fell in the middle half of that time). With the GIL held during the wait the
    count is 0: this thread could run only at the edges.
    """
    window: list[float] = []
    stamps: list[float] = []

    def timed() -> None:
        window.append(time.perf_counter())
        communicate()
        window.append(time.perf_counter())

    worker = threading.Thread(target=timed)
    worker.start()
    while worker.is_alive():
        stamps.append(time.perf_counter())
    worker.join()
    t0, t1 = window
    quarter = 0.25 * (t1 - t0)
    return t1 - t0, sum(t0 + quarter < s < t1 - quarter for s in stamps)
