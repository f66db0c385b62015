"""An optimizer with ``overlap=True`` is freed once the program drops it: the optimizer itself,
its communication thread, and its communicator channel (a gloo group of 5 MB and n − 1
connections per rank, which stayed alive before and grew a process by that much per
optimizer: docs/overlap.md)."""

from __future__ import annotations

import gc
import threading
import weakref

import torch

import commopt
from tests.multirank.harness import run_ranks


def _six_optimizers(backend) -> list[tuple[bool, list[str], int]]:
    torch.manual_seed(backend.rank)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 32))
    seen = []
    for _ in range(6):
        opt = commopt.OnebitAdam(
            model.parameters(),
            lr=1e-3,
            freeze_step=1,
            overlap=True,
            bucket_numel=5000,
            backend=backend,
        )
        gen = torch.Generator().manual_seed(backend.rank)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 64, generator=gen)).sum().backward()
            opt.step()
        ref = weakref.ref(opt)
        del opt
        gc.collect()
        threads = [t.name for t in threading.enumerate() if t.name.startswith("commopt-")]
        seen.append((ref() is None, threads, len(backend._channels)))
    return seen


def test_dropped_overlap_optimizers_free_thread_and_channel() -> None:
    for seen in run_ranks(_six_optimizers, 2, timeout=240):
        assert seen == [(True, [], 0)] * 6
