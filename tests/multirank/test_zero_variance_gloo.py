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

from tests.multirank.harness import run_ranks
from tests.optim_registry import BY_NAME

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


FREEZE = 12  # the last full-precision step (0/1 Adam: variance steps 1, 2, 4, 6, 8, 12)


def _train(backend, name: str, late_from: int):
    del backend  # the default backend set by the harness
    torch.manual_seed(0)
    table = torch.nn.Parameter(torch.randn(ROWS, COLS))
    start = table.detach().clone()
    opt = BY_NAME[name].make([table], freeze=FREEZE)
    history = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, STEPS + 1):
            table.grad = _grad(torch.distributed.get_rank(), step, late_from)
            opt.step()
            history.append(table.detach().clone())
    messages = [str(w.message) for w in caught if "zero variance" in str(w.message)]
    return {"start": start, "history": history, "warnings": messages}


@pytest.mark.parametrize("name", list(BY_NAME))
def test_rows_with_zero_variance_stay_put_and_replicas_agree(name: str) -> None:
    info, late_from = BY_NAME[name], 9  # before the freeze; for 0/1 Adam a 1-bit step
    results = run_ranks(_train, 2, name, late_from, timeout=TIMEOUT)
    start, history = results[0]["start"], results[0]["history"]
    final = history[-1]
    assert bool(torch.isfinite(final).all())
    for row in DEAD:
        assert torch.equal(final[row], start[row]), f"dead row {row} moved: {final[row]}"
    live = [r for r in range(ROWS) if r not in DEAD and r != LATE]
    assert all(not torch.equal(final[r], start[r]) for r in live)
    assert info.communicates(STEPS, FREEZE)
    assert torch.equal(final, results[1]["history"][-1])
    # row 2's v stays 0 until the first step from late_from on that updates the variance (1-bit
    # Adam and LAMB: step 9 itself; 0/1 Adam: 9–11 are 1-bit steps, the next variance step 12)
    moves_at = min(
        t
        for ph in info.phases(STEPS, FREEZE)
        if ph.updates_variance
        for t in ph.steps
        if t >= late_from
    )
    for step in range(1, moves_at):
        assert torch.equal(history[step - 1][LATE], start[LATE]), step
    assert not torch.equal(history[moves_at - 1][LATE], start[LATE])
    # the guard says so, once, on rank 0 only
    assert len(results[0]["warnings"]) == 1, results[0]["warnings"]
    assert f"{name}: " in results[0]["warnings"][0]
    assert results[1]["warnings"] == []


@pytest.mark.parametrize("name", list(BY_NAME))
def test_gradients_that_start_after_the_freeze_do_not_move_a_zero_variance_row(name: str) -> None:
    """Row 2 gets gradients only after the freeze (from step 13), where v is frozen at 0 for
    it: neither compressed steps nor 0/1 Adam's local steps and syncs may move it (m/ε would
    be ~1e6 per step)."""
    results = run_ranks(_train, 2, name, FREEZE + 1, timeout=TIMEOUT)
    for res in results:
        start = res["start"]
        for step, table in enumerate(res["history"], start=1):
            assert torch.equal(table[LATE], start[LATE]), step
            assert float(table.abs().max()) < 10.0, step
