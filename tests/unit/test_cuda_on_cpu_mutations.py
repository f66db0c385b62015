"""The CUDA-on-CPU checks catch broken kernels: each test breaks cuda/ on purpose and requires
the check that should notice to fail.

Three kinds of mistake (issue #14): a wrong bit order, a dropped ``__syncthreads``, and an
off-by-one in a grid stride. Each mutation is a text replacement on ``cuda_source()`` (so the
replaced text must exist: a test also fails if the source drifts away from it), compiled and run
through the same checks as tests/unit/test_cuda_on_cpu.py. The stride mutations pass the
wrapper-level check (the wrappers launch enough blocks that no loop wraps) and are caught only by
the grid-stride check, which is why that check exists. A fourth kind belongs to the staged
server step (issue #12): a range's offset dropped in the server kernel, which averaging the whole
chunk from offset 0 cannot notice and the staged check must.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable

import pytest

from commopt.kernels.cuda_sources import cuda_source
from commopt.kernels.cupy_kernels import CupyKernels

if shutil.which("g++") is None:
    pytest.skip("g++ is not installed (scripts/test.sh installs it)", allow_module_level=True)

from tests.cuda_on_cpu import CpuRuntime, KernelLaunchError
from tests.cuda_on_cpu.checks import (
    SERVER_BLOCK,
    check_against_reference,
    check_finish_rms,
    check_grid_stride,
    check_server_grid_stride,
    check_server_stages,
)

B = SERVER_BLOCK

DETECTED = (AssertionError, KernelLaunchError)


def mutate(files: tuple[str, ...], old: str, new: str, index: int) -> Callable[[str], str]:
    """A ``source`` for CpuRuntime: ``cuda_source`` with occurrence ``index`` of ``old``
    replaced by ``new`` in each of ``files`` (block_sum.cuh is pasted into worker and server)."""

    def source(name: str) -> str:
        text = cuda_source(name)
        if name not in files:
            return text
        parts = text.split(old)
        assert len(parts) > index + 1, f"{name} has no occurrence {index} of {old!r}"
        return old.join(parts[: index + 1]) + new + old.join(parts[index + 1 :])

    return source


def wrappers(runtime: CpuRuntime) -> None:
    """The wrapper-level check: 20 000 elements on 3 ranks, so 20 blocks and mixed signs."""
    check_against_reference(CupyKernels(runtime=runtime), 20_000, 3, 5, 3)


BIT_ORDER = {
    # LSB-first packing of a thread's 4 signs (pack_worker_, pack_compensated_, the server's
    # re-pack all use commopt_signs4) ...
    "nibble packed LSB first": (
        ("worker.cu",),
        "(px ? 8u : 0u) | (py ? 4u : 0u) | (pz ? 2u : 0u) | (pw ? 1u : 0u)",
        "(px ? 1u : 0u) | (py ? 2u : 0u) | (pz ? 4u : 0u) | (pw ? 8u : 0u)",
        0,
    ),
    # ... and the two nibbles of a byte in the wrong order.
    "byte's nibbles swapped": (("worker.cu",), "(nibble << 4) | next", "(next << 4) | nibble", 0),
    "server reads bits LSB first": (
        ("server.cu",),
        "(bits >> (7 - k)) & 1u",
        "(bits >> k) & 1u",
        0,
    ),
    "unpack reads bits LSB first": (
        ("unpack.cu",),
        "(byte >> (7 - j)) & 1u",
        "(byte >> j) & 1u",
        0,
    ),
}


@pytest.mark.parametrize("mutation", sorted(BIT_ORDER))
def test_a_wrong_bit_order_fails_the_check(mutation):
    runtime = CpuRuntime(fibers=True, source=mutate(*BIT_ORDER[mutation]))
    with pytest.raises(DETECTED):
        wrappers(runtime)


@pytest.mark.parametrize(
    "runtime_args",
    [{"jitter": True, "seed": 1}, {"fibers": True, "jitter": True, "seed": 1}],
    ids=["os-threads", "fibers"],
)
def test_a_dropped_syncthreads_fails_under_randomised_scheduling(runtime_args):
    """commopt_block_sum without its barrier: thread 0 reads warp sums not yet written (or
    left over from the previous block, since __shared__ is not cleared)."""
    source = mutate(("worker.cu", "server.cu"), "__syncthreads();", "", 0)
    with pytest.raises(DETECTED, match=r"compensate s|scale s|server_reduce_ t"):
        wrappers(CpuRuntime(source=source, **runtime_args))


STRIDE = "(long long)gridDim.x * blockDim.x;"
STRIDES = [
    # (file, occurrence of STRIDE): compensate, scale, pack_update, pack_compensated; unpack
    ("worker.cu", 0),
    ("worker.cu", 1),
    ("worker.cu", 2),
    ("worker.cu", 3),
    ("unpack.cu", 0),
]


@pytest.mark.parametrize("file,index", STRIDES)
def test_an_off_by_one_grid_stride_fails_the_grid_stride_check(file, index):
    runtime = CpuRuntime(fibers=True, source=mutate((file,), STRIDE, STRIDE[:-1] + " + 1;", index))
    wrappers(runtime)  # the wrappers' grids cover the data in one pass: no loop wraps ...
    with pytest.raises(DETECTED):  # ... so only a grid smaller than the data notices
        check_grid_stride(runtime, 3, 40_000, 2, seed=1)


def test_an_off_by_one_server_block_stride_fails_the_server_grid_stride_check():
    """The server kernel's loop over pairs of 1024-element blocks (one CUDA block each)."""
    source = mutate(("server.cu",), "p += gridDim.x)", "p += gridDim.x + 1)", 0)
    runtime = CpuRuntime(fibers=True, source=source)
    wrappers(runtime)  # one CUDA block per element block: the block loop never wraps ...
    check_server_stages(CupyKernels(runtime=runtime), 3 * B + 8, 3, 1, [(0, B), (B, 3 * B + 8)])
    with pytest.raises(DETECTED, match=r"commopt_server_average"):  # ... unless the grid is small
        check_server_grid_stride(runtime, 1, 5 * B + 8, 2, seed=1, split=2 * B)


# The staged server step: a range's offset dropped, in f or in the partial sums. Averaging the
# whole chunk in one launch (offset 0) cannot notice; the staged check must.
RANGE_OFFSETS = {
    "f offset dropped": ("float* const range = f + lo;", "float* const range = f;"),
    "partial offset dropped": (
        "partial + lo / COMMOPT_SERVER_BLOCK;",
        "partial + 0 / COMMOPT_SERVER_BLOCK;",
    ),
}


@pytest.mark.parametrize("mutation", sorted(RANGE_OFFSETS))
def test_a_dropped_range_offset_fails_the_staged_check(mutation):
    old, new = RANGE_OFFSETS[mutation]
    kernels = CupyKernels(
        runtime=CpuRuntime(fibers=True, source=mutate(("server.cu",), old, new, 0))
    )
    wrappers(kernels.runtime)  # server_reduce_ averages from offset 0: unaffected ...
    with pytest.raises(AssertionError, match=r"staged"):  # ... the staged step is not
        check_server_stages(kernels, 3 * B + 8, 3, 1, [(2 * B, 3 * B + 8), (0, B), (B, 2 * B)])


def test_an_off_by_one_row_stride_fails_the_grid_stride_check():
    runtime = CpuRuntime(
        fibers=True, source=mutate(("unpack.cu",), "row += gridDim.y", "row += gridDim.y + 1", 0)
    )
    wrappers(runtime)  # the wrapper launches one y-block per row: the row loop never wraps
    with pytest.raises(DETECTED, match=r"commopt_unpack_scaled"):
        check_grid_stride(runtime, 3, 40_000, 2, seed=1)


def test_an_off_by_one_stride_in_finish_rms_fails_its_check():
    source = mutate(("worker.cu",), "i += blockDim.x)", "i += blockDim.x + 1)", 0)
    runtime = CpuRuntime(fibers=True, source=source)
    check_finish_rms(runtime, 200)  # one pass: the stride is never taken
    with pytest.raises(AssertionError, match=r"finish_rms"):
        check_finish_rms(runtime, 1000)


# The norm finished by the last block (issue #23): which block is last, and the counter the next
# launch on the same workspace relies on.
def test_a_last_block_chosen_by_index_fails_under_a_random_block_order():
    """Taking the highest blockIdx as the last one to finish is right only when blocks finish
    in order; the jittered build runs them in a random order."""
    source = mutate(
        ("worker.cu", "server.cu"),
        "last = atomicAdd(done, 1u) == gridDim.x - 1;",
        "last = (atomicAdd(done, 1u), blockIdx.x == gridDim.x - 1);",
        0,
    )
    wrappers(CpuRuntime(fibers=True, source=source))  # blocks in order: unnoticed ...
    with pytest.raises(DETECTED, match=r"compensate s|scale s|server_reduce_ t"):
        wrappers(CpuRuntime(fibers=True, jitter=True, seed=2, source=source))


def test_a_counter_left_set_fails_the_next_call():
    source = mutate(("worker.cu", "server.cu"), "*done = 0u;", "", 0)
    with pytest.raises(DETECTED, match=r"s |t "):
        wrappers(CpuRuntime(fibers=True, source=source))


MISALIGNED = """
import numpy as np, torch
from commopt.kernels.cuda_sources import cuda_source
from commopt.kernels.cupy_kernels import CupyKernels
from tests.cuda_on_cpu import CpuRuntime

def source(name):
    return cuda_source(name).replace(
        "return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull;", "return p != nullptr;"
    )

kernels = CupyKernels(runtime=CpuRuntime(fibers=True, source=source))
x = torch.zeros(4097)[1:]
kernels.scale(x, torch.zeros(4096))
print("no fault")
"""


def test_a_vector_access_at_a_misaligned_address_aborts():
    """A kernel that used 16-byte accesses on a view at an odd offset would fault on a GPU;
    the CPU build aborts (-fsanitize=alignment), in a child process here."""
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run(
        [sys.executable, "-c", MISALIGNED],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode != 0 and "no fault" not in proc.stdout, proc.stdout
    assert "misaligned address" in proc.stderr, proc.stderr[-2000:]
