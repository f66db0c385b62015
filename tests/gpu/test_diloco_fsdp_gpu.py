"""commopt.DiLoCo over FSDP2 shards with CUDA parameters, and with ``CPUOffloadPolicy``.

4 spawned ranks share one GPU over gloo (one GPU cannot host two NCCL ranks), on a 2 × 2
(replicate, shard) mesh: each replica is one DiLoCo worker, its shard group's reduce-scatter
averaging inside it, and DiLoCo syncs each shard over the replicate group, the first sync at
fp32 and the others at one bit. Checks: the anchors and error buffers live where the shards do
(the GPU, or the host under offload), the replicas' shards differ between syncs and are
bit-identical after each, and the loss goes down.

Skipped without a CUDA GPU; on CPU the same run is tests/multirank/test_diloco_fsdp_gloo.py.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible to torch", allow_module_level=True)

from tests.gpu.sharded_mlp import sharded_mlp, train
from tests.multirank.harness import run_ranks

H, STEPS = 4, 12


def train_diloco_on_shards(backend, device: str, offload: bool) -> dict:
    """One rank's run (also called with ``device="cpu"`` to check this body without a GPU)."""
    import commopt

    del backend
    if device == "cuda":
        torch.cuda.set_device(0)
    model, mesh = sharded_mlp(device, offload)
    replicate = commopt.TorchBackend(mesh.get_group("replicate"))
    opt = commopt.DiLoCo(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        sync_every=H,
        fp32_syncs=1,
        backend=replicate,
    )
    losses, same = train(model, opt, device, STEPS, replicate)
    state = opt.state_dict()["commopt"]
    return {
        "losses": losses,
        "same": same,
        "shards": {p.to_local().device.type for p in model.parameters()},
        "anchors": {f.anchor.device.type for f in opt.parts},
        "errors": {t.device.type for b in state["buckets"] for t in b.values()},
        "compressed": opt.comm_stats()["sync_bytes"] - opt.comm_stats()["fp32_sync_bytes"],
    }


@pytest.mark.parametrize("offload", [False, True], ids=["cuda-shards", "cpu-offload"])
def test_diloco_on_fsdp2_shards_on_a_gpu(offload: bool) -> None:
    results = run_ranks(train_diloco_on_shards, 4, "cuda", offload, timeout=600.0, start="spawn")
    where = {"cpu"} if offload else {"cuda"}
    for r in results:
        assert r["shards"] == r["anchors"] == where, r
        assert r["errors"] == where, r
        assert r["compressed"] > 0  # syncs 2 and 3 went at one bit
        assert r["same"] == [(step + 1) % H == 0 for step in range(STEPS)], r["same"]
        assert r["losses"][-1] < r["losses"][0], r["losses"]
