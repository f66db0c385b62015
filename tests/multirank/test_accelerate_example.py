"""The accelerate example trains on 2 ranks with commopt.OnebitAdam through the DDP hook."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multirank.harness import run_example_under_torchrun

pytest.importorskip("accelerate", reason="the example needs accelerate: pip install 'commopt[hf]'")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "accelerate_onebit_adam.py"


def test_accelerate_example_trains_on_two_ranks(tmp_path):
    result = run_example_under_torchrun(
        EXAMPLE, ["--steps", "30", "--freeze-step", "10", "--accumulation", "2"], tmp_path
    )
    assert result["world_size"] == 2
    losses = result["losses"]
    assert len(losses) == 30
    assert losses[-1] < 0.2 * losses[0], losses
    assert result["replicas_identical"]
    stats = result["comm_stats"]
    # Through the hook, on the last of the 2 backward passes of each step only (accelerate's
    # no_sync on the first): 10 fp32 averages of the optimizer's one bucket, then 20 exchanges.
    assert stats["full_precision_rounds"] == 10
    assert stats["compressed_rounds"] == 20
    assert stats["skipped_steps"] == 0
