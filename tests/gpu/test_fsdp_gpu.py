"""commopt on FSDP2 with CUDA parameters and with ZeRO-Offload (``CPUOffloadPolicy``).

4 spawned ranks share one GPU over gloo (one GPU cannot host two NCCL ranks), on a 2 × 2
(replicate, shard) mesh. With ``CPUOffloadPolicy`` the parameter shards, their gradients and the
optimizer state live in host memory: forward and backward run on the GPU, the optimizer's step
on the CPU with commopt's numba kernels. Checks: the state is where it should be, the replicas
are bit-identical after every communicating step, and the loss goes down.

Skipped without a CUDA GPU (``CPUOffloadPolicy`` needs one: on a machine without a GPU the
parameters are on the host already, the ordinary CPU path that tests/multirank/test_fsdp_gloo.py
runs).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible to torch", allow_module_level=True)

from tests.gpu.sharded_mlp import sharded_mlp, train
from tests.multirank.harness import run_ranks
from tests.optim_registry import OPTIMIZERS

WORLD = 4
TIMEOUT = 600.0
STEPS = 12


def _train(backend, offload: bool):
    import commopt.fsdp

    del backend
    torch.cuda.set_device(0)
    out = {}
    for info in OPTIMIZERS:
        model, mesh = sharded_mlp("cuda", offload)
        opt = info.make(list(model.parameters()), backward=True)
        sharding = commopt.fsdp.attach(model, opt, mesh)
        losses, same = train(model, opt, "cuda", STEPS, sharding.replicate)
        devices = {str(t.device.type) for s in opt.flat_states for t in s.flat.values()}
        shard_devices = {p.to_local().device.type for p in model.parameters()}
        out[info.name] = {"losses": losses, "same": same, "state": devices, "shards": shard_devices}
    return out


@pytest.mark.parametrize("offload", [False, True], ids=["cuda-shards", "cpu-offload"])
def test_fsdp_on_a_gpu(offload: bool) -> None:
    results = run_ranks(_train, WORLD, offload, timeout=TIMEOUT, start="spawn")
    where = "cpu" if offload else "cuda"
    for info in OPTIMIZERS:
        communicating = {
            s for ph in info.phases(STEPS, backward=True) if ph.communicates for s in ph.steps
        }
        for result in results:
            r = result[info.name]
            assert r["state"] == {where} and r["shards"] == {where}, r
            assert all(r["same"][s - 1] for s in communicating), r["same"]
            assert r["losses"][-1] < r["losses"][0], r["losses"]
