"""commopt.DiLoCo on a real GPU: tests/diloco_matrix.py's modes on 4 ranks sharing one GPU over
gloo with CUDA tensors (one GPU cannot host two NCCL ranks): the parameters stay finite,
replicas are bit-identical after every sync, streaming syncs run on the communication thread
with CUDA tensors, and a resume with a sync in flight is bit-exact. Skipped without a CUDA GPU;
the same matrix runs in CI on CPU (tests/multirank/test_diloco_gloo.py)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible to torch", allow_module_level=True)

from tests.diloco_matrix import check_diloco, run_diloco
from tests.multirank.harness import run_ranks


def _on_gpu(backend):
    torch.cuda.set_device(0)
    return run_diloco(backend, "cuda")


def test_diloco_matrix_on_one_gpu_over_gloo_with_cuda_tensors() -> None:
    check_diloco(run_ranks(_on_gpu, 4, timeout=600.0, start="spawn"))
