"""The FSDP2 example trains each optimizer under torchrun on 2 replicas × 2 shards."""

from __future__ import annotations

from pathlib import Path

from tests.multirank.harness import run_example_under_torchrun
from tests.optim_registry import OPTIMIZERS

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fsdp_hsdp.py"


def test_fsdp_example_trains_every_optimizer_under_torchrun(tmp_path):
    args = ["--steps", "40", "--freeze-step", "10"]
    result = run_example_under_torchrun(EXAMPLE, args, tmp_path, nproc=4)
    assert result["world_size"] == 4 and result["shards"] == 2
    assert set(result["optimizers"]) == {info.name for info in OPTIMIZERS}
    for name, entry in result["optimizers"].items():
        losses = entry["losses"]
        assert len(losses) == 40
        assert losses[-1] < 0.5 * losses[0], (name, losses)
        assert entry["exchange"] == "sharded:2x2:0.0"
        assert entry["comm_stats"]["compressed_rounds"] > 0, name
    assert result["optimizers"]["OnebitAdam"]["resume_bit_exact"]
