"""The GPU users' matrix in CI, without a GPU: every optimizer × {standalone, overlap=True, DDP
hook at two bucket sizes} on 4 forked gloo ranks (tests/device_matrix.py), with

- the per-element work in the CUDA kernels, executed on the CPU (``CupyKernels`` on the
  tests/cuda_on_cpu runtime: the exact cuda/ text and launch wrappers; the fiber scheduler, the
  same barriers and checks for ~18x less CPU time than an OS thread per CUDA thread, which
  tests/unit/test_cuda_on_cpu.py runs, with jitter, on the kernels alone), and
- scratch poisoned (``COMMOPT_POISON_SCRATCH=1``): work buffers are dropped after every step and
  created full of NaN, as a GPU drops them and hands back stale memory. Whatever the optimizer
  reads from a buffer it did not write in the same step turns into NaN here.

What a GPU run could still show and this cannot: stream ordering (tests/gpu/test_multirank_gpu.py
and tests/unit/test_handoff.py), and differences inside torch's own CUDA operators.

1-bit LAMB's replicas diverged on CUDA because its step wrote m_prev into one scratch buffer and
read it from another (a fresh allocation per call on a GPU, the kept buffer on CPU):
``test_the_matrix_catches_a_scratch_buffer_that_does_not_persist`` brings that behaviour back
and checks that the matrix fails.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from commopt.kernels import use_kernels
from commopt.kernels.cupy_kernels import CupyKernels
from commopt.optim.flat_state import FlatState
from tests.device_matrix import check_matrix, run_matrix
from tests.multirank.harness import run_ranks
from tests.optim_registry import OPTIMIZERS

if shutil.which("g++") is None:
    pytest.skip("g++ is not installed (scripts/test.sh installs it)", allow_module_level=True)

from tests.cuda_on_cpu import CpuRuntime

WORLD = 4
TIMEOUT = 280.0


def _body(backend, name: str, modes: tuple[str, ...] | None = None):
    with use_kernels(CupyKernels(runtime=CpuRuntime(fibers=True))):
        if modes is None:
            return run_matrix(backend, "cpu", [name])
        return run_matrix(backend, "cpu", [name], modes)


@pytest.mark.parametrize("name", [i.name for i in OPTIMIZERS])
def test_matrix_with_cuda_kernels_on_cpu_threads(name: str, monkeypatch) -> None:
    monkeypatch.setenv("COMMOPT_POISON_SCRATCH", "1")
    check_matrix(run_ranks(_body, WORLD, name, timeout=TIMEOUT))


def test_the_matrix_catches_a_scratch_buffer_that_does_not_persist(monkeypatch) -> None:
    """The GPU behaviour 1-bit LAMB tripped over: a new buffer for every scratch() call."""

    def fresh(self, name: str) -> torch.Tensor:
        del name
        return torch.full((self.bucket.numel,), float("nan"))

    monkeypatch.setattr(FlatState, "scratch", fresh)
    results = run_ranks(_body, WORLD, "OnebitLamb", ("standalone",), timeout=TIMEOUT)
    with pytest.raises(AssertionError, match="non-finite"):
        check_matrix(results)
