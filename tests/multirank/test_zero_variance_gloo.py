"""Elements whose variance is exactly zero do not move (commopt's guard, all three optimizers).

The 1-bit code has no zero: an element whose gradient is 0 on every rank still comes back from
the compressed exchange as ±scale. Where its variance v is 0 (zero gradient on every
full-precision step so far: unused embedding rows, dead units) the step m/(√v + ε) would be
divided by ε alone. The byte-level demo's loss went to NaN that way with 0/1 Adam. These tests
run 2 gloo ranks with per-rank gradients set directly, rows of an embedding-like table being
"dead" (always zero), "late" (zero until some step), or "live".
"""

from __future__ import annotations

import warnings

import pytest
import torch

from commopt import OnebitAdam, OnebitLamb, ZeroOneAdam
from tests.multirank.harness import run_ranks

TIMEOUT = 120.0
ROWS, COLS = 8, 6
DEAD, LATE = (0, 1), 2  # rows 0 and 1 never get a gradient; row 2 only from step LATE_FROM
STEPS = 24


def _grad(rank: int, step: int, late_from: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * rank + step)
    g = torch.randn(ROWS, COLS, generator=gen) * (1 + rank)
    g[list(DEAD)] = 0.0
    if step < late_from:
        g[LATE] = 0.0
    return g


def _make(name: str, params):
    if name == "OnebitAdam":
        return OnebitAdam(params, lr=1e-2, freeze_step=6)
    if name == "OnebitLamb":
        return OnebitLamb(params, lr=1e-2, freeze_step=6)
    # variance steps 1, 2, 4, 6, 8, 12; phase B from step 13, syncs every 1, then 2 steps
    return ZeroOneAdam(
        params,
        lr=1e-2,
        var_freeze_step=12,
        var_update_scaler=2,
        local_step_scaler=4,
        local_step_clipper=2,
    )


def _train(backend, name: str, late_from: int):
    del backend  # the default backend set by the harness
    torch.manual_seed(0)
    table = torch.nn.Parameter(torch.randn(ROWS, COLS))
    start = table.detach().clone()
    opt = _make(name, [table])
    history = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, STEPS + 1):
            table.grad = _grad(torch.distributed.get_rank(), step, late_from)
            opt.step()
            history.append(table.detach().clone())
    messages = [str(w.message) for w in caught if "zero variance" in str(w.message)]
    return {"start": start, "history": history, "warnings": messages}


@pytest.mark.parametrize("name", ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"])
def test_rows_with_zero_variance_stay_put_and_replicas_agree(name: str) -> None:
    late_from = 9  # inside the compression stage / phase A after the variance steps 1–8
    results = run_ranks(_train, 2, name, late_from, timeout=TIMEOUT)
    start, history = results[0]["start"], results[0]["history"]
    final = history[-1]
    assert bool(torch.isfinite(final).all())
    for row in DEAD:
        assert torch.equal(final[row], start[row]), f"dead row {row} moved: {final[row]}"
    live = [r for r in range(ROWS) if r not in DEAD and r != LATE]
    assert all(not torch.equal(final[r], start[r]) for r in live)
    # the last step (24) is a sync step for 0/1 Adam, a compressed step for the others
    assert torch.equal(final, results[1]["history"][-1])
    if name == "ZeroOneAdam":
        # row 2's first gradient comes at step 9, not a variance step: v is still 0 there, so
        # it stays; the variance step 12 gives it a variance and it moves from then on
        for step in range(1, 12):
            assert torch.equal(history[step - 1][LATE], start[LATE]), step
        assert not torch.equal(history[11][LATE], start[LATE])
    else:  # the variance froze at step 6 with row 2 at zero: it never moves
        assert torch.equal(final[LATE], start[LATE])
    # the guard says so, once, on rank 0 only
    assert len(results[0]["warnings"]) == 1, results[0]["warnings"]
    assert f"{name}: " in results[0]["warnings"][0]
    assert results[1]["warnings"] == []


def test_zero_one_phase_b_discards_local_gradients_where_v_is_zero() -> None:
    """Row 2 gets gradients only in phase B (from step 13), where v is frozen at 0 for it:
    neither its local steps nor the syncs may move it (locally m/ε would be ~1e6 per step)."""
    results = run_ranks(_train, 2, "ZeroOneAdam", 13, timeout=TIMEOUT)
    for res in results:
        start = res["start"]
        for step, table in enumerate(res["history"], start=1):
            assert torch.equal(table[LATE], start[LATE]), step
            assert float(table.abs().max()) < 10.0, step
