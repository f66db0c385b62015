"""Adversarial futures: a missing ``wait()`` on a hand-off fails here, on CPU, as it would
silently on a GPU (commopt/comm/handoff.py states the rule).

On a GPU a completed future only says the host side is done: a reader whose stream was not
ordered after the producer's with ``wait()`` may read the tensor's old contents. The DDP hook's
replicas diverged that way on CUDA (``CUDA_LAUNCH_BLOCKING=1`` hid it). Here
:class:`LateFuture` plays that part: completing it with a tensor fills the tensor with NaN (or
a garbage integer), and only its own ``wait()`` puts the real values back. Every asynchronous
collective of the backend (:class:`LateBackend`) and every placeholder future of the early work
(``commopt.optim._early``) is such a future, on 4 forked gloo ranks, for every optimizer ×
{standalone, overlap=True, DDP hook at two bucket sizes} (tests/device_matrix.py): a reader
that takes a value without waiting ends with NaN parameters or differs from standalone.

Futures handed to DDP itself stay real: DDP waits on them in C++, which a Python fake cannot
intercept.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import commopt.optim._early._work as early
from commopt.comm import TorchBackend
from tests.device_matrix import WHOLE_MODES, check_matrix, run_matrix
from tests.multirank.harness import run_ranks
from tests.optim_registry import OPTIMIZERS


class LateFuture(torch.futures.Future):
    """A future whose tensor holds garbage until someone calls this future's ``wait()``."""

    def set_result(self, result: Any) -> None:
        if isinstance(result, torch.Tensor):
            self._late = result.clone()
            result.fill_(float("nan") if result.is_floating_point() else 91)
        super().set_result(result)

    def wait(self) -> Any:
        value = super().wait()
        late = self.__dict__.pop("_late", None)
        if late is not None:
            value.copy_(late)
        return value


def _late(value: torch.Tensor) -> torch.futures.Future:
    fut = LateFuture()
    fut.set_result(value)
    return fut


class LateBackend:
    """A TorchBackend whose asynchronous collectives return :class:`LateFuture` s."""

    def __init__(self, inner: TorchBackend) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def all_reduce_async(self, t: torch.Tensor, op: str = "sum") -> torch.futures.Future:
        return _late(self._inner.all_reduce(t, op))

    def all_gather_async(self, out: torch.Tensor, t: torch.Tensor) -> torch.futures.Future:
        return _late(self._inner.all_gather(out, t))

    def all_to_all_async(self, out: torch.Tensor, t: torch.Tensor) -> torch.futures.Future:
        return _late(self._inner.all_to_all(out, t))


def _body(backend: TorchBackend, name: str):
    return run_matrix(LateBackend(backend), "cpu", [name], WHOLE_MODES)


@pytest.mark.parametrize("name", [i.name for i in OPTIMIZERS])
def test_every_hand_off_waits(name: str, monkeypatch) -> None:
    monkeypatch.setattr(early, "device_future", lambda device: LateFuture())
    check_matrix(run_ranks(_body, 4, name, timeout=240.0))


def test_late_future_is_adversarial() -> None:
    t = torch.ones(3)
    fut = _late(t)
    assert fut.done() and bool(fut.value().isnan().all())
    assert fut.wait().tolist() == [1.0, 1.0, 1.0]
