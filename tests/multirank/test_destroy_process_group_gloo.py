"""commopt.destroy_process_group() ends a gloo run that torch's call would deadlock.

The deadlock CI saw in the Hugging Face example: a DDP model holds its process group from C++,
so when the model is freed after ``torch.distributed.destroy_process_group()``, gloo's
destructor joins its worker threads with the GIL held; a worker still freeing the last
collective's tensors needs the GIL, and the two wait for each other. Here it is made certain:
the last collective's tensor carries a finalizer that sleeps, so the worker that frees it is
busy for half a second after the collective completed, and rank 0 lets go of the collective
while it is still in flight, so gloo's worker is the one that frees the tensor.
"""

from __future__ import annotations

import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist

import commopt
from commopt import launch
from tests.multirank.harness import run_ranks


def _end_with_a_collective_in_flight(backend: commopt.Backend, ours: bool) -> bool:
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))  # holds the group
    released = threading.Event()
    if dist.get_rank() == 1:
        time.sleep(0.3)  # rank 0's collective is in flight meanwhile
    x = torch.ones(4)
    weakref.finalize(x, lambda: (time.sleep(0.5), released.set()))
    dist.all_reduce(x, async_op=True)  # nobody keeps the work: gloo's worker frees it
    del x
    (commopt.destroy_process_group if ours else dist.destroy_process_group)()
    freed_before_return = released.is_set()
    del model  # the group's destructor runs here, as when a script's locals die
    return freed_before_return


def test_returns_after_gloo_freed_the_last_collective_and_the_model_dies_cleanly():
    assert run_ranks(_end_with_a_collective_in_flight, 2, True, timeout=30) == [True, True]


def test_control_torch_destroy_then_the_model_deadlocks():
    # (one rank or both: on a loaded machine one of them may get past before the other stalls)
    with pytest.raises(TimeoutError, match=r"ranks \[[01, ]+\] did not finish"):
        run_ranks(_end_with_a_collective_in_flight, 2, False, timeout=10)


def _end_after_a_collective(backend: commopt.Backend) -> bool:
    x = torch.ones(4)
    dist.all_reduce(x)
    commopt.destroy_process_group()
    return dist.is_initialized()


def test_a_torch_without_use_count_gets_the_barrier_and_the_pause(monkeypatch):
    # Forked ranks inherit the patched module: destroy_process_group() cannot wait on the
    # probe's count there, and still ends the group on every rank.
    monkeypatch.setattr(launch, "_use_count", None)
    assert run_ranks(_end_after_a_collective, 2, timeout=30) == [False, False]


def test_refuses_without_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialized"):
        commopt.destroy_process_group()
