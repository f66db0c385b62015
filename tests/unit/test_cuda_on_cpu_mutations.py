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
    """The wrapper-level check: 20 000 elements on 3 ranks, so 79 blocks and mixed signs."""
    check_against_reference(CupyKernels(runtime=runtime), 20_000, 3, 5, 3)


BIT_ORDER = {
    # LSB-first packing in the warp-ballot pack of pack_worker_ / the server's re-pack ...
    "pack_update ballot not reversed": (
        ("worker.cu",),
        "(__brev(ballot) >> (24 - lane))",
        "(ballot >> lane)",
        0,
    ),
    # ... and in pack_compensated_, which compressed_allreduce uses.
    "pack_compensated ballot not reversed": (
        ("worker.cu",),
        "(__brev(ballot) >> (24 - lane))",
        "(ballot >> lane)",
        1,
    ),
    "server reads bits LSB first": (("server.cu",), "7 - (int)(j & 7)", "(int)(j & 7)", 0),
    "unpack reads bits LSB first": (("unpack.cu",), "(7 - (int)(q & 7))", "((int)(q & 7))", 0),
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
        check_grid_stride(runtime, 3, 20_000, 5, seed=1)


def test_an_off_by_one_server_block_stride_fails_the_server_grid_stride_check():
    """The server kernel's loop over 1024-element blocks (one CUDA block each, grid-strided)."""
    source = mutate(("server.cu",), "b += gridDim.x)", "b += gridDim.x + 1)", 0)
    runtime = CpuRuntime(fibers=True, source=source)
    wrappers(runtime)  # one CUDA block per element block: the block loop never wraps ...
    check_server_stages(CupyKernels(runtime=runtime), 3 * B + 8, 3, 1, [(0, B), (B, 3 * B + 8)])
    with pytest.raises(DETECTED, match=r"commopt_server_average"):  # ... unless the grid is small
        check_server_grid_stride(runtime, 1, 3 * B + 8, 2, seed=1, split=B)


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
    wrappers(kernels._runtime)  # server_reduce_ averages from offset 0: unaffected ...
    with pytest.raises(AssertionError, match=r"staged"):  # ... the staged step is not
        check_server_stages(kernels, 3 * B + 8, 3, 1, [(2 * B, 3 * B + 8), (0, B), (B, 2 * B)])


def test_an_off_by_one_row_stride_fails_the_grid_stride_check():
    runtime = CpuRuntime(
        fibers=True, source=mutate(("unpack.cu",), "row += gridDim.y", "row += gridDim.y + 1", 0)
    )
    wrappers(runtime)  # the wrapper launches one y-block per row: the row loop never wraps
    with pytest.raises(DETECTED, match=r"commopt_unpack_scaled"):
        check_grid_stride(runtime, 3, 20_000, 5, seed=1)


def test_an_off_by_one_stride_in_finish_rms_fails_its_check():
    source = mutate(("worker.cu",), "i += blockDim.x)", "i += blockDim.x + 1)", 0)
    runtime = CpuRuntime(fibers=True, source=source)
    check_finish_rms(runtime, 200)  # one pass: the stride is never taken
    with pytest.raises(AssertionError, match=r"finish_rms"):
        check_finish_rms(runtime, 1000)
