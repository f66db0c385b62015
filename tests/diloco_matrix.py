"""DiLoCo's modes on several ranks, on any device: what a user of the outer loop relies on.

Every mode of :data:`MODES` (each compression; streaming fragments with a delayed sync on the
communication thread; warmup with a Nesterov outer step; the first syncs in fp32) trains the
same small MLP from a different initialisation on every rank (the constructor must broadcast
rank 0's), on per-rank batches. :func:`run_diloco` returns, per mode, the digest of every
fragment right after each of its syncs is applied, the final digest after ``finish()``, and the
final digest of a run that was stopped mid-interval (with a delayed sync in flight where the
mode has one), saved with ``state_dict()``, rebuilt from scratch, loaded and finished.
:func:`check_diloco` asserts over every rank's results:

1. the parameters stay finite;
2. right after every sync, the synced fragment is bit-identical on every rank;
3. after ``finish(model.buffers())`` the whole model, BatchNorm's statistics included, is
   bit-identical on every rank;
4. the resumed run ends bit for bit where the uninterrupted one does, on every rank.

Used by tests/multirank/test_diloco_gloo.py (4 forked gloo ranks on CPU) and
tests/gpu/test_diloco_gpu.py (4 spawned ranks sharing one GPU over gloo with CUDA tensors).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Sequence
from typing import Any

import torch

import commopt
from commopt.diloco.fragments import first_sync_offsets

__all__ = ["MODES", "SYNC_EVERY", "check_diloco", "one_rank_past_a_sync", "run_diloco"]

SYNC_EVERY = 6
STEPS = 20
RESUME_AT = 9  # mid-interval; with fragments=2, delay=1 fragment 0's sync is then in flight
# fp32_syncs=0: 1 bit from the first sync (the default would run this short run's syncs at fp32)
MODES: dict[str, dict[str, Any]] = {
    "onebit": dict(compression="onebit", fp32_syncs=0),
    "none": dict(compression="none"),
    "bf16": dict(compression="bf16"),
    "onebit-streaming": dict(compression="onebit", fragments=2, delay=1, fp32_syncs=0),
    "none-streaming": dict(compression="none", fragments=2, delay=2),
    "onebit-warmup-nesterov": dict(
        compression="onebit", warmup_steps=4, outer_lr=0.7, outer_momentum=0.9, fp32_syncs=0
    ),
    # fragment 0 syncs at 3, 9 (fp32, in flight at RESUME_AT) and 15 (1 bit); fragment 1 at
    # 6, 12 (fp32) and 18
    "onebit-fp32-first-streaming": dict(compression="onebit", fragments=2, delay=1, fp32_syncs=2),
}


def _model(rank: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(100 + rank)  # a different start on every rank: DiLoCo broadcasts rank 0's
    return torch.nn.Sequential(
        torch.nn.Linear(12, 32),
        torch.nn.BatchNorm1d(32),  # running statistics of each rank's own data
        torch.nn.GELU(),
        torch.nn.Linear(32, 24),
        torch.nn.Linear(24, 4),
    ).to(device)


def _digest(tensors: Sequence[torch.Tensor]) -> str:
    flat = torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])
    return hashlib.sha1(flat.numpy().tobytes()).hexdigest()[:16]


def _applied(step: int, kw: dict[str, Any]) -> list[int]:
    """Fragments whose sync is applied in ``step``, from the documented schedule."""
    s = step - kw.get("delay", 0) - kw.get("warmup_steps", 0)
    offsets = first_sync_offsets(SYNC_EVERY, kw.get("fragments", 1))
    return [p for p, o in enumerate(offsets) if s >= o and (s - o) % SYNC_EVERY == 0]


def _train(model, opt, rank: int, steps: range, kw: dict[str, Any], events: list) -> None:
    device = next(model.parameters()).device
    for step in steps:
        g = torch.Generator().manual_seed(7919 * step + 31 * rank)
        x = torch.randn(16, 12, generator=g).to(device)
        loss = ((model(x) - x[:, :4].sin()) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        for p in _applied(step, kw):
            events.append((step, p, _digest(opt.parts[p].params)))


def _build(backend: Any, kw: dict[str, Any], device: torch.device):
    model = _model(backend.rank, device)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return model, commopt.DiLoCo(inner, sync_every=SYNC_EVERY, backend=backend, **kw)


def _one(backend: Any, kw: dict[str, Any], device: torch.device) -> dict[str, Any]:
    rank = backend.rank
    model, opt = _build(backend, kw, device)
    events: list = []
    _train(model, opt, rank, range(1, STEPS + 1), kw, events)
    opt.finish(model.buffers())
    final = _digest([*model.parameters(), *model.buffers()])
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())

    model, opt = _build(backend, kw, device)
    _train(model, opt, rank, range(1, RESUME_AT + 1), kw, [])
    in_flight = len(opt.progress.pending)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    del model, opt
    model, opt = _build(backend, kw, device)
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    _train(model, opt, rank, range(RESUME_AT + 1, STEPS + 1), kw, [])
    opt.finish(model.buffers())
    return {
        "events": events,
        "final": final,
        "finite": finite,
        "resumed": _digest([*model.parameters(), *model.buffers()]),
        "in_flight_at_save": in_flight,
    }


def run_diloco(
    backend: Any, device: str | torch.device = "cpu", modes: Sequence[str] = tuple(MODES)
) -> dict[str, dict[str, Any]]:
    """Train every mode on this rank (module docstring); ``{mode: results}``."""
    device = torch.device(device)
    return {mode: _one(backend, MODES[mode], device) for mode in modes}


def check_diloco(results: Sequence[dict[str, dict[str, Any]]]) -> None:
    """Assert 1.–4. of the module docstring over every rank's :func:`run_diloco` result."""
    problems = []
    for mode, first in results[0].items():
        mine = [r[mode] for r in results]
        if not all(m["finite"] for m in mine):
            problems.append(f"{mode}: non-finite parameters")
        if not first["events"]:
            problems.append(f"{mode}: no sync was applied")
        for k, event in enumerate(first["events"]):
            got = [m["events"][k] for m in mine]
            if len(set(got)) != 1:
                problems.append(f"{mode}: fragment {event[1]} differs after step {event[0]}: {got}")
                break
        if len({m["final"] for m in mine}) != 1:
            problems.append(f"{mode}: replicas differ after finish(): {[m['final'] for m in mine]}")
        for rank, m in enumerate(mine):
            if m["resumed"] != m["final"]:
                problems.append(f"{mode}: rank {rank}'s resumed run differs from the uninterrupted")
        if MODES[mode].get("delay") and not first["in_flight_at_save"]:
            problems.append(f"{mode}: no sync was in flight at the save (the test lost its point)")
    assert not problems, "\n".join(problems)


def one_rank_past_a_sync() -> tuple[torch.nn.Module, torch.optim.Optimizer, commopt.DiLoCo]:
    """(model, inner SGD, DiLoCo) on one rank, H = 4, two steps past the sync at step 4: what
    the end-of-training callbacks ``finish()``."""
    from commopt.comm import SingleProcessBackend

    model = torch.nn.Linear(2, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = commopt.DiLoCo(inner, sync_every=4, backend=SingleProcessBackend())
    for _ in range(6):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert opt.progress.last_sync == [4]
    return model, inner, opt
