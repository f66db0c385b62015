"""The accelerate example trains on 2 ranks with commopt.OnebitAdam through the DDP hook."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multirank.harness import run_example_under_torchrun

pytest.importorskip("accelerate", reason="the example needs accelerate: pip install 'commopt[hf]'")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "accelerate_onebit_adam.py"


def _trained(tmp_path, *args: str) -> dict:
    """The example's result.json after 30 steps of 2 backward passes on 2 ranks, checked for
    what every run must show: the loss fell fivefold and the ranks end with one model."""
    result = run_example_under_torchrun(
        EXAMPLE, ["--steps", "30", "--accumulation", "2", *args], tmp_path
    )
    assert result["world_size"] == 2
    losses = result["losses"]
    assert len(losses) == 30
    assert losses[-1] < 0.2 * losses[0], losses
    assert result["replicas_identical"]
    return result


def test_accelerate_example_trains_on_two_ranks(tmp_path):
    stats = _trained(tmp_path, "--freeze-step", "10")["comm_stats"]
    # Through the hook, on the last of the 2 backward passes of each step only (accelerate's
    # no_sync on the first): 10 fp32 averages of the optimizer's one bucket, then 20 exchanges.
    assert stats["full_precision_rounds"] == 10
    assert stats["compressed_rounds"] == 20
    assert stats["skipped_steps"] == 0


def test_accelerate_example_with_diloco_keeps_the_inner_steps_local(tmp_path):
    """``--diloco 5``: DiLoCo around AdamW, torch's noop_hook on the prepared DDP model, steps
    taken through the AcceleratedOptimizer (once per 2 backward passes): 30 inner steps, 6
    syncs, one model at the end, and no lockstep warning (DDP averaged nothing)."""
    result = _trained(tmp_path, "--diloco", "5")  # one model: step 30 is a sync
    assert not result["lockstep_warned"]
    stats = result["comm_stats"]
    assert (stats["steps"], stats["syncs"]) == (30, 6)


@pytest.mark.parametrize(
    "args",
    [["--diloco", "4", "--steps", "32"], ["--freeze-step", "10", "--steps", "30"]],
    ids=["DiLoCo", "OnebitAdam"],
)
def test_a_resume_from_save_state_and_save_checkpoint_is_bit_exact(tmp_path, args):
    """After step 15 (DiLoCo between syncs, 1-bit Adam in its 1-bit stage) the example saves
    accelerate's state and commopt.save_checkpoint beside it; the run resumed from there ends
    with the bits of the run that saved."""
    saved = run_example_under_torchrun(EXAMPLE, [*args, "--save-at", "15"], tmp_path)
    folder = tmp_path / "step-15"
    resumed = run_example_under_torchrun(EXAMPLE, [*args, "--resume", str(folder)], tmp_path)
    assert saved["replicas_identical"] and resumed["replicas_identical"]
    assert len(resumed["losses"]) == len(saved["losses"]) - 15
    assert resumed["parameters_sha256"] == saved["parameters_sha256"]
