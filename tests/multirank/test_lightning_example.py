"""Lightning trains a LightningModule on 2 ranks with each commopt optimizer through
commopt.lightning.OnebitHookCallback, bit-identical to the standalone optimizer; a run resumed
from a Lightning checkpoint starts from every rank's own state with
commopt.lightning.RankStateCheckpoint, and not without it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multirank.harness import run_example_under_torchrun
from tests.optim_registry import BY_NAME

pytest.importorskip("lightning", reason="needs Lightning: pip install 'commopt[lightning]'")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_commopt.py"


def test_lightning_example_equals_standalone_for_each_optimizer(tmp_path):
    args = ["--steps", "30", "--freeze-step", "10", "--resume-check"]
    result = run_example_under_torchrun(EXAMPLE, args, tmp_path)
    assert result["world_size"] == 2
    runs = result["optimizers"]
    assert set(runs) == {*BY_NAME, "DiLoCo"}
    for name, run in runs.items():  # step 16's weights and optimizer state, on every rank
        assert run["resume_bit_exact"] == {"with_callback": True, "without": False}, name
    diloco = runs.pop("DiLoCo")  # through the callback's noop_hook: local inner steps
    assert diloco["equals_standalone"] and diloco["replicas_identical"]  # step 30 is a sync
    assert diloco["losses"][-1] < diloco["losses"][0], diloco["losses"]
    assert (diloco["comm_stats"]["steps"], diloco["comm_stats"]["syncs"]) == (30, 6)
    for name, run in runs.items():
        assert run["equals_standalone"], name  # on every rank, bit for bit
        assert len(run["losses"]) == 30, name
        assert run["losses"][-1] < run["losses"][0], (name, run["losses"])
        stats = run["comm_stats"]
        assert stats["full_precision_rounds"] == 10, (name, stats)  # the warmup, through DDP
        assert stats["compressed_rounds"] > 0, (name, stats)
        assert stats["skipped_steps"] == 0, (name, stats)
    # 0/1 Adam's replicas differ between its sync steps by design; the others never.
    assert runs["OnebitAdam"]["replicas_identical"]
    assert runs["OnebitLamb"]["replicas_identical"]
    assert runs["OnebitAdam"]["comm_stats"]["compressed_rounds"] == 20


def test_lightning_example_under_fp16_amp_equals_the_standalone_loop_by_hand(tmp_path):
    """``--amp fp16``: Lightning's fp16 plugin with a GradScaler. The callback's
    ClippingMixedPrecision unscales the gradients after the closure, as Lightning does for
    torch.optim.Adam; the standalone run leaves the unscaling to the optimizer's step
    (GradScaler.step hands it the scale). The same bits on every rank. (A first scale that
    does not overflow: where one rank overflows, the DDP hook's average carries its inf to
    every rank, whose scales all back off, and the runs part by design; the one-process test
    in tests/unit/test_lightning_callback.py covers overflows.)"""
    args = ["--steps", "20", "--freeze-step", "6", "--amp", "fp16", "--init-scale", "16"]
    runs = run_example_under_torchrun(EXAMPLE, args, tmp_path)["optimizers"]
    assert set(runs) == {*BY_NAME, "DiLoCo"}
    for name, run in runs.items():
        assert run["equals_standalone"], name
        assert run["comm_stats"]["skipped_steps"] == 0, name
        assert run["losses"][-1] < run["losses"][0], (name, run["losses"])


def test_lightning_example_clips_under_bf16_amp(tmp_path):
    """``--amp bf16 --clip 0.5``: Lightning's own AMP plugin raised for every commopt optimizer
    ("does not allow for gradient clipping"); through the callback it trains, through the
    DDP hook and into the 1-bit stage, with the replicas one model where they share."""
    args = ["--steps", "20", "--freeze-step", "6", "--amp", "bf16", "--clip", "0.5"]
    runs = run_example_under_torchrun(EXAMPLE, args, tmp_path)["optimizers"]
    assert set(runs) == {*BY_NAME, "DiLoCo"}
    for name, run in runs.items():
        assert run["equals_standalone"] is None, name  # (not compared: see --clip)
        assert run["losses"][-1] < run["losses"][0], (name, run["losses"])
        if name != "ZeroOneAdam":  # (its replicas differ between its syncs by design)
            assert run["replicas_identical"], name
        if name in BY_NAME:
            assert run["comm_stats"]["compressed_rounds"] > 0, name
