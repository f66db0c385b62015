"""Non-blocking collectives on forked gloo ranks: same bytes as the blocking ones, and no GIL held.

- ``all_reduce_async``/``all_gather_async``/``all_to_all_async`` through TorchBackend
  (``async_op=True``) and through a backend without them (the synchronous fallback) give the
  blocking result bit for bit, with several collectives in flight, waited on in any order.
- A thread blocked in a gloo collective lets the main thread run Python: rank 1 joins the
  collective a second late, and rank 0's main thread must make progress in the middle of its
  worker thread's wait (with the GIL held there, it could run only at the edges).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from commopt.comm import all_gather_async, all_reduce_async, all_to_all_async
from tests.multirank.gil_probe import poll_during
from tests.multirank.harness import run_ranks

TIMEOUT = 120.0


class _BlockingOnly:
    """A backend with the synchronous contract only (like MixedBackend): forces the fallback."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name, self.rank, self.world_size = "blocking", inner.rank, inner.world_size
        self.stats = inner.stats

    def all_reduce(self, t, op="sum"):
        return self.inner.all_reduce(t, op)

    def all_gather(self, out, t):
        return self.inner.all_gather(out, t)

    def all_to_all(self, out, t):
        return self.inner.all_to_all(out, t)


def _data(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(numel, generator=gen) * 1e3
    return x.to(dtype) if dtype.is_floating_point else (x.to(torch.int64) % 256).to(dtype)


def compare_async_with_blocking(backend) -> dict:
    """The async collectives against the blocking ones, bit for bit, on CPU tensors; returns a
    digest of what each gathered."""
    n = backend.world_size
    results = {}
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        for name, be in (("torch", backend), ("fallback", _BlockingOnly(backend))):
            numel = 24 * n + 8 * n  # divisible by n for all_to_all
            x = _data(backend.rank, numel, dtype)
            # Blocking reference.
            ref_gather = torch.empty(n * numel, dtype=dtype)
            backend.all_gather(ref_gather, x)
            ref_a2a = torch.empty_like(x)
            backend.all_to_all(ref_a2a, x)
            # Three collectives in flight, waited on last-started first.
            gather = torch.empty(n * numel, dtype=dtype)
            a2a = torch.empty_like(x)
            futs = [all_gather_async(be, gather, x), all_to_all_async(be, a2a, x)]
            if dtype.is_floating_point:
                ref_red = x.clone()
                backend.all_reduce(ref_red, "avg")
                red = x.clone()
                futs.append(all_reduce_async(be, red, "avg"))
            values = [f.wait() for f in reversed(futs)][::-1]
            assert values[0] is gather and values[1] is a2a
            assert torch.equal(gather.view(torch.uint8), ref_gather.view(torch.uint8))
            assert torch.equal(a2a.view(torch.uint8), ref_a2a.view(torch.uint8))
            if dtype.is_floating_point:
                assert values[2] is red
                assert torch.equal(red.view(torch.uint8), ref_red.view(torch.uint8))
            results[(str(dtype), name)] = gather.float().sum().item()
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_async_collectives_equal_blocking_ones(world_size: int) -> None:
    results = run_ranks(compare_async_with_blocking, world_size, timeout=TIMEOUT)
    assert all(r == results[0] for r in results)  # every rank gathered the same data


ATTEMPTS = 3


def _gil_during_collective(backend, how: str) -> list[tuple[float, int]]:
    """Rank 1 joins each collective a second late; rank 0 returns, per attempt, how long its
    worker thread waited and how often its main thread ran in the middle half of that wait."""
    t = torch.ones(1 << 10)

    def communicate() -> None:
        if how == "blocking":
            dist.all_reduce(t)
        else:
            all_to_all_async(backend, torch.empty_like(t), t).wait()

    tries = []
    for _ in range(ATTEMPTS):  # the same collectives on both ranks, whatever the outcome
        dist.barrier()  # rank 1's delay starts when rank 0 is ready
        if backend.rank == 1:
            time.sleep(1.0)
            communicate()
            continue
        tries.append(poll_during(communicate))
    return tries


@pytest.mark.parametrize("how", ["blocking", "future"])
def test_waiting_in_a_gloo_collective_releases_the_gil(how: str) -> None:
    """With the GIL held during the wait the main thread could never run in its middle; the
    retries only absorb a main thread the OS did not schedule on a loaded machine."""
    tries = run_ranks(_gil_during_collective, 2, how, timeout=TIMEOUT)[0]
    assert all(w > 0.5 for w, _ in tries), tries  # the worker did wait for rank 1
    assert any(m > 0 for _, m in tries), tries  # and the main thread ran meanwhile
