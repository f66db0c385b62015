"""The numba kernels release the GIL, so a communication thread does not stall backward.

Every compiled loop is declared ``nogil=True`` (checked on the dispatchers), and for the kernels
that write their output front to back the release is observed: while one thread runs the kernel
on a large buffer, the main thread reads the first and the last element of what the kernel
writes, both in one numpy call (``view[[0, -1]]``, which holds the GIL throughout). Seeing them
in different states (the front already written, the back not yet) is only possible if that read
ran *during* the kernel call: with the GIL held by the kernel the read could happen only before
the call or after it, where both ends agree. So the test cannot pass by luck of timing; under
heavy load it retries until the scheduler lets the main thread run during one of the calls.
``scale`` (a pure reduction, nothing to observe half done)
is covered by the declaration check: it is compiled with the same ``nogil`` decorator.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch

pytest.importorskip("numba", reason="numba is not installed; nothing to test")
import numba

import commopt.kernels.numba_loops as loops
from commopt.kernels.numba_kernels import NumbaKernels

FAST = NumbaKernels()
N = 1 << 24  # 16M elements: a few ms of kernel time per call
ATTEMPTS = 60


def test_every_compiled_loop_is_declared_nogil() -> None:
    dispatchers = {
        name: obj
        for name, obj in vars(loops).items()
        if isinstance(obj, numba.core.registry.CPUDispatcher)
    }
    assert {"scale_sum", "pack_compensated", "server_average", "unpack"} <= set(dispatchers)
    assert {n: d.targetoptions.get("nogil") for n, d in dispatchers.items()} == dict.fromkeys(
        dispatchers, True
    )


ENDS = np.array([0, -1])


def _observe_partial(
    reset: Callable[[], None], run: Callable[[], None], view: np.ndarray
) -> tuple[int, int]:
    """Run ``run`` in a thread, up to ATTEMPTS times, while this thread polls both ends of
    ``view`` (what ``run`` writes front to back), atomically with respect to the GIL.

    Returns (attempts made, polls that saw the two ends differ). Stops at the first attempt in
    which a partial state was seen.
    """
    FAST.warm_up()
    for attempt in range(1, ATTEMPTS + 1):
        reset()
        first, last = view[ENDS]
        assert first == last, "the reset state must have equal ends"
        worker = threading.Thread(target=run)
        partial = 0
        worker.start()
        while worker.is_alive():
            first, last = view[ENDS]  # one C call: the GIL is held for both reads
            partial += first != last
        worker.join()
        first, last = view[ENDS]
        assert first == last, "the final state must have equal ends"
        if partial:
            return attempt, partial
    return ATTEMPTS, 0


def test_pack_compensated_releases_the_gil() -> None:
    x, e = torch.ones(N), torch.zeros(N)
    bits = torch.empty(N // 8, dtype=torch.uint8)
    s = torch.ones(1)
    view = bits.numpy()

    def reset() -> None:
        bits.zero_()
        e.zero_()

    attempts, partial = _observe_partial(reset, lambda: FAST.pack_compensated_(x, s, e, bits), view)
    assert partial > 0, f"no poll saw pack_compensated_ half done in {attempts} calls"
    assert (view == 0xFF).all() and bool((e == 0).all())  # and the kernel still did its job


def test_server_reduce_releases_the_gil() -> None:
    n = 4
    recv = torch.full((n, N // (8 * n)), 0xFF, dtype=torch.uint8)
    scales = torch.ones(n)
    f = torch.empty(N // n)
    out_bits = torch.empty(N // (8 * n), dtype=torch.uint8)
    view = f.numpy()
    # f = 0.5 → c_s = 1 + 0.5 (written front to back) → f = c_s − t·sgn(c_s) = 0 (front to back).

    def run() -> None:
        t = FAST.server_reduce_(recv, scales, f, out_bits)
        assert float(t) == 1.5

    attempts, partial = _observe_partial(lambda: f.fill_(0.5), run, view)
    assert partial > 0, f"no poll saw server_reduce_ half done in {attempts} calls"
    assert (view == 0).all()


def test_unpack_scaled_releases_the_gil() -> None:
    n = 4
    bits = torch.full((n, N // (8 * n)), 0xFF, dtype=torch.uint8)
    scales = torch.full((n,), 2.0)
    out = torch.empty(N)
    view = out.numpy()
    attempts, partial = _observe_partial(
        lambda: out.zero_(),
        lambda: FAST.unpack_scaled_(bits, scales, out),
        view,
    )
    assert partial > 0, f"no poll saw unpack_scaled_ half done in {attempts} calls"
    assert np.all(view == 2.0)
