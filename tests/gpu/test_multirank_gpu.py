"""The optimizer × mode matrix on a real GPU: 4 ranks sharing one GPU (one GPU cannot host two
NCCL ranks), over gloo with CUDA tensors and over MPI with host staging (tests/device_matrix.py).

Checks: the parameters stay finite; replicas bit-identical after every communicating step;
``overlap=True`` and the DDP hook (DDP buckets of ~4 KB and of 25 MB) bitwise equal to the
standalone optimizer after every step; and the GPU run's final parameters within
:data:`GPU_VS_CPU` (relative, ‖p_gpu − p_cpu‖/‖p_cpu‖) of the same standalone run on CPU with the
numba kernels, on the same ranks: the 1-bit exchange's signs can flip where a value is within
rounding of 0, so the GPU and CPU runs agree closely but not bit for bit.

Skipped without a CUDA GPU; the MPI case also without mpi4py and ``mpiexec``. The same matrix
runs in CI on CPU with the CUDA kernels on CPU threads (tests/multirank/test_device_logic_gloo.py).
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible to torch", allow_module_level=True)

from tests.device_matrix import WHOLE_MODES, check_matrix, run_matrix
from tests.multirank.harness import run_ranks
from tests.multirank.test_async_gloo import compare_async_with_blocking
from tests.multirank.test_backends_gloo import check_collective_results, collective_results

WORLD = 4
TIMEOUT = 600.0
GPU_VS_CPU = 1e-3
ROOT = Path(__file__).resolve().parents[2]


def _gpu_and_cpu(backend):
    torch.cuda.set_device(0)
    gpu = run_matrix(backend, "cuda", modes=WHOLE_MODES)
    cpu = run_matrix(backend, "cpu", modes=("standalone",))
    return gpu, cpu


def _check_gpu_vs_cpu(gpu: dict, cpu: dict) -> list[str]:
    problems = []
    for (name, mode), ref in cpu.items():
        got = gpu[(name, mode)]["params"]
        rel = float((got - ref["params"]).norm() / ref["params"].norm())
        print(f"{name}: GPU vs CPU relative parameter difference {rel:.2e}")
        if not rel <= GPU_VS_CPU:
            problems.append(f"{name}: GPU vs CPU {rel:.2e} > {GPU_VS_CPU}")
    return problems


def test_matrix_on_one_gpu_over_gloo_with_cuda_tensors() -> None:
    results = run_ranks(_gpu_and_cpu, WORLD, timeout=TIMEOUT, start="spawn")
    check_matrix([gpu for gpu, _ in results])
    problems = []
    for gpu, cpu in results:
        problems += _check_gpu_vs_cpu(gpu, cpu)
    assert not problems, "\n".join(problems)


def test_matrix_on_one_gpu_over_mpi_with_host_staging(tmp_path: Path) -> None:
    pytest.importorskip("mpi4py")
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("no mpiexec on PATH")
    out = tmp_path / "matrix.pkl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "PMIX_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [mpiexec, "-n", str(WORLD), "--oversubscribe", sys.executable, "-m"]
    cmd += ["tests.gpu.mpi_matrix", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    check_matrix(pickle.loads(out.read_bytes()))


def _fsdp_on_gpu(backend):
    torch.cuda.set_device(0)
    return run_matrix(backend, "cuda", modes=("standalone", "fsdp", "hsdp"))


def test_fsdp_modes_on_one_gpu_over_gloo_with_cuda_tensors() -> None:
    """FSDP2 with CUDA shards (commopt.fsdp): 4 × 1 bitwise equal to standalone, 2 × 2 with
    bit-identical replicas (gloo's collectives on CUDA tensors, the 4 ranks on one GPU)."""
    check_matrix(run_ranks(_fsdp_on_gpu, WORLD, timeout=TIMEOUT, start="spawn"))


# NCCL alone has no CPU backend ("No backend type associated with device type cpu"), and
# commopt's agreement checks and counters are small CPU tensors; TorchBackend copies them to the
# GPU and back. One GPU cannot host two NCCL ranks, so "cuda:gloo" stands in for NCCL here: a
# group of the same shape, CUDA only, on 4 ranks sharing the GPU.
def _without_a_cpu_backend(backend):
    torch.cuda.set_device(0)
    assert backend.cpu_staging == "cuda"
    collectives = collective_results(backend)
    compare_async_with_blocking(backend)
    return collectives, run_matrix(backend, "cuda", modes=WHOLE_MODES)


def test_on_a_group_without_a_cpu_backend_as_nccls_cpu_tensors_travel_through_the_gpu() -> None:
    results = run_ranks(
        _without_a_cpu_backend, WORLD, timeout=TIMEOUT, start="spawn", engine="cuda:gloo"
    )
    check_collective_results([collectives for collectives, _ in results])
    check_matrix([matrix for _, matrix in results])
