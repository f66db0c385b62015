"""The Hugging Face Trainer example trains a tiny GPT-2 on 2 ranks with commopt.OnebitAdam,
through the DDP hook (commopt.ddp), with two backward passes per step."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.multirank.harness import run_example_under_torchrun

pytest.importorskip(
    "transformers", reason="the example needs transformers: pip install 'commopt[hf]'"
)
pytest.importorskip("accelerate", reason="the Trainer needs accelerate: pip install 'commopt[hf]'")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer_gpt2.py"


def _trained(tmp_path, steps: int, fall: float, *args: str) -> dict:
    """The example's result.json after ``steps`` steps on 2 ranks, checked for what every run
    must show: a loss logged every 5 steps that fell below ``fall`` of the first, one model."""
    result = run_example_under_torchrun(
        EXAMPLE,
        ["--max-steps", str(steps), *args],
        tmp_path,
        env=dict(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1"),
    )
    losses = result["losses"]
    assert result["world_size"] == 2
    assert len(losses) == steps // 5
    assert losses[-1] < fall * losses[0], losses
    assert result["replicas_identical"]
    return result


def test_trainer_example_trains_on_two_ranks(tmp_path):
    result = _trained(tmp_path, 30, 0.85, "--freeze-step", "10", "--accumulation", "2")
    stats = result["comm_stats"]
    # The hook did the communication, on the last backward pass of each step only (accelerate
    # runs the first under no_sync): one fp32 average of the optimizer's single bucket in each
    # of the 10 warmup steps, then one 1-bit exchange in each of the other 20 (a synced first
    # pass would have doubled both).
    assert stats["full_precision_rounds"] == 10
    # The Trainer clips (max_grad_norm=1.0) after backward. On CPU the hook leaves the 1-bit
    # exchange to step() by default (exchange_in_backward=None), which reads the clipped
    # p.grad: one exchange per step, none redone. (In backward, the first one would be redone
    # once: tests/multirank/test_ddp_hook_after_backward_gloo.py.)
    assert stats["compressed_rounds"] == 20


def test_trainer_example_with_diloco_keeps_the_inner_steps_local(tmp_path):
    """``--diloco 10``: DiLoCo around AdamW under the Trainer's DDP model, with torch's noop_hook
    so that DDP leaves the gradients local: the replicas differ before every sync and end as one
    model, and the only traffic is DiLoCo's (the first 5 syncs at fp32 by default, then 1 bit)."""
    result = _trained(tmp_path, 80, 0.5, "--diloco", "10")
    assert result["differed_before_syncs"] == [True] * 8
    stats = result["comm_stats"]
    assert (stats["steps"], stats["syncs"], stats["syncs_at_fp32"]) == (80, 8, 5)
    assert 0 < stats["compressed_bits_per_parameter_per_step"] <= 1.05 * 2 / 10


@pytest.mark.parametrize(
    "args",
    [
        ["--diloco", "10", "--max-steps", "40"],  # step 15: the ranks' own weights and AdamW state
        ["--freeze-step", "10", "--max-steps", "30"],  # step 15: 1-bit, each rank's error buffers
    ],
    ids=["DiLoCo", "OnebitAdam"],
)
def test_trainer_resume_from_a_checkpoint_is_bit_exact(tmp_path, args):
    """The Trainer saves rank 0's optimizer state alone; commopt.hf.RankStateCheckpoint, in the
    example, adds every rank's own (commopt.save_checkpoint) and loads it when the resumed run
    begins. The run resumed from step 15 ends with the bits of the run that saved there."""
    env = dict(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    straight = run_example_under_torchrun(EXAMPLE, [*args, "--save-steps", "15"], tmp_path, env=env)
    checkpoint = tmp_path / "checkpoint-15"
    assert (checkpoint / "commopt").is_dir() and (checkpoint / "optimizer.pt").is_file()
    resumed = run_example_under_torchrun(
        EXAMPLE, [*args, "--resume", str(checkpoint)], tmp_path, env=env
    )
    assert resumed["replicas_identical"] and straight["replicas_identical"]
    assert resumed["parameters_sha256"] == straight["parameters_sha256"]
    # The control: without every rank's own state (the callback's folder gone, as for a
    # checkpoint saved without it), the ranks other than 0 resume from rank 0's and the run
    # ends elsewhere (docs/checkpoints.md).
    shutil.rmtree(checkpoint / "commopt")
    without = run_example_under_torchrun(
        EXAMPLE, [*args, "--resume", str(checkpoint)], tmp_path, env=env
    )
    assert without["parameters_sha256"] != straight["parameters_sha256"]
