"""commopt.DiLoCo on a real GPU: tests/diloco_matrix.py's modes on 4 ranks sharing one GPU over
gloo with CUDA tensors (one GPU cannot host two NCCL ranks): the parameters stay finite,
replicas are bit-identical after every sync, streaming syncs run on the communication thread
with CUDA tensors, and a resume with a sync in flight is bit-exact. fp16 loss scaling with an
overflow on one rank keeps every rank on the sync schedule. Skipped without a CUDA GPU; the
same tests run in CI on CPU (tests/multirank/test_diloco_gloo.py)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible to torch", allow_module_level=True)

from tests.diloco_matrix import check_diloco, run_diloco
from tests.multirank.harness import run_ranks
from tests.multirank.test_diloco_gloo import SCALED, check_scaled, scaled_run


def _on_gpu(backend):
    torch.cuda.set_device(0)
    return run_diloco(backend, "cuda")


def test_diloco_matrix_on_one_gpu_over_gloo_with_cuda_tensors() -> None:
    check_diloco(run_ranks(_on_gpu, 4, timeout=600.0, start="spawn"))


def test_diloco_matrix_on_a_group_without_a_cpu_backend_as_nccls() -> None:
    """ "cuda:gloo" stands in for NCCL (tests/gpu/test_multirank_gpu.py says why): DiLoCo's
    agreement checks, step counts and finiteness flags are CPU tensors, staged through the GPU."""
    check_diloco(run_ranks(_on_gpu, 4, timeout=600.0, start="spawn", engine="cuda:gloo"))


def _scaled_on_gpu(backend, setup: str, use_scaler: bool):
    torch.cuda.set_device(0)
    return scaled_run(backend, setup, use_scaler, "cuda")


@pytest.mark.parametrize("setup", list(SCALED))
def test_grad_scaler_on_cuda_skips_the_overflowing_inner_step_and_keeps_the_schedule(setup):
    """torch.amp.GradScaler("cuda") with CUDA gradients (the fused Adam row: CUDA's fused
    kernel unscales and skips), an inf on one rank: bit for bit the run that dropped it."""
    scaled = run_ranks(_scaled_on_gpu, 2, setup, True, timeout=300.0, start="spawn")
    plain = run_ranks(_scaled_on_gpu, 2, setup, False, timeout=300.0, start="spawn")
    check_scaled(setup, scaled, plain)
