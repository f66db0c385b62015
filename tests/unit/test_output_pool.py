"""compressed_allreduce(out=None) on CPU reuses a released result's buffer, never a held one."""

from __future__ import annotations

import weakref

import torch

import commopt
from commopt.comm import SingleProcessBackend
from commopt.compressed import padded_size
from commopt.output_pool import OutputPool, _counts_work


def test_the_reference_counts_work_here() -> None:
    assert _counts_work()  # CPython 3.10-3.13 and torch >= 2.4: the pool is in use


BACKEND = SingleProcessBackend()


def _call(x: torch.Tensor) -> torch.Tensor:
    e, f = torch.zeros(padded_size(x.numel(), 1)), torch.zeros(padded_size(x.numel(), 1))
    return commopt.compressed_allreduce(x, e, f, BACKEND)


def _x(seed: int) -> torch.Tensor:
    return torch.randn(1000, generator=torch.Generator().manual_seed(seed))


def test_a_dropped_result_lends_its_buffer_to_the_next_call() -> None:
    y = _call(_x(0))
    first = weakref.ref(y)
    del y
    y = _call(_x(1))
    assert first() is y and torch.equal(y, _x(1))


def test_held_results_and_views_are_never_overwritten() -> None:
    held = [_call(_x(k)) for k in range(5)]  # all alive: five buffers
    assert len({y.data_ptr() for y in held}) == 5
    view = _call(_x(10))[100:200]  # only a view survives
    later = [_call(_x(k)) for k in range(20, 25)]
    for k, y in enumerate(held):
        assert torch.equal(y, _x(k))
    assert torch.equal(view, _x(10)[100:200])
    for k, y in zip(range(20, 25), later, strict=True):
        assert torch.equal(y, _x(k))


def test_a_result_autograd_saved_is_not_reused() -> None:
    w = torch.ones(1000, requires_grad=True)
    loss = (_call(_x(0)) * w).sum()  # no Python name holds the result: autograd does
    for k in range(1, 4):
        _call(_x(k))
    loss.backward()
    assert torch.equal(w.grad, _x(0))


def test_the_usual_loop_alternates_two_buffers() -> None:
    refs = []
    y = None
    for k in range(6):
        y = _call(_x(k))  # the previous result is still bound to y during the call
        refs.append(weakref.ref(y))
        assert torch.equal(y, _x(k))
    alive = [r() for r in refs]
    assert all(t is not None for t in alive)  # kept by the pool, not freed and reallocated
    assert len({id(t) for t in alive}) == 2


def test_other_devices_and_a_full_pool_allocate() -> None:
    pool = OutputPool(capacity=1)
    meta = torch.empty(8, device="meta")
    assert pool.like(meta) is not pool.like(meta)  # not CPU: never kept
    a = pool.like(torch.empty(4))
    del a
    pool.like(torch.empty(5))  # another shape: the first is forgotten (capacity 1)
    assert [key[0] for key in pool._kept] == [(5,)]
