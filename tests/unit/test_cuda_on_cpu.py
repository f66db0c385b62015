"""The CUDA C kernels of cuda/ executed on the CPU, through CupyKernels, against TorchKernels.

No GPU anywhere: tests/cuda_on_cpu compiles the exact ``cuda_source()`` text with g++ and a
header that maps CUDA's built-ins onto CPU threads, and ``CupyKernels(runtime=CpuRuntime())``
runs the real launch wrappers on it. Two schedulers run the same code: one OS thread per CUDA
thread of a block (the model; slow, so on smaller cases) and ucontext fibers (the same
barriers, ~18x less CPU time; the hypothesis sweep up to 10^5 elements). Contract as in
tests/cuda_on_cpu/checks.py: bit for bit given the same scales; s and t to one ulp of fp64.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from commopt.kernels.cuda_sources import cuda_source
from commopt.kernels.cupy_kernels import CupyKernels
from commopt.pipelined import ALIGN, stage_ranges

if shutil.which("g++") is None:
    pytest.skip("g++ is not installed (scripts/test.sh installs it)", allow_module_level=True)

from tests.cuda_on_cpu import CpuRuntime, KernelLaunchError, compile_source
from tests.cuda_on_cpu.checks import (
    SERVER_BLOCK,
    THREADS,
    check_against_reference,
    check_finish_rms,
    check_grid_stride,
    check_server_grid_stride,
    check_server_stages,
)

FIBERS = CpuRuntime(fibers=True)
OS_THREADS = CpuRuntime()
ENTRIES = {
    "commopt_compensate",
    "commopt_scale",
    "commopt_finish_rms",
    "commopt_pack_update",
    "commopt_pack_compensated",
    "commopt_server_average",
    "commopt_unpack_scaled",
}


# -- bit identity through the real wrappers ------------------------------------------------------
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    size=st.one_of(st.integers(1, 64), st.integers(1, 100_000)),
    n=st.integers(1, 9),
    seed=st.integers(0, 2**32 - 1),
    spread=st.integers(0, 15),
)
@example(size=100_000, n=9, seed=1, spread=15)
@example(size=1, n=1, seed=2, spread=0)
def test_cuda_kernels_match_torch_kernels(size, n, seed, spread):
    """Sizes 1…10⁵, world sizes 1…9, magnitudes up to 1e±15 with ±0 and subnormals (fibers)."""
    check_against_reference(CupyKernels(runtime=FIBERS), size, n, seed, spread)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    size=st.integers(1, 2000),
    n=st.integers(1, 9),
    seed=st.integers(0, 2**32 - 1),
    spread=st.integers(0, 15),
)
@example(size=2049, n=3, seed=3, spread=15)  # 9 blocks of 256 OS threads
def test_os_thread_model_matches_torch_kernels(size, n, seed, spread):
    """The same check with one OS thread per CUDA thread (fewer, smaller cases: it is slow)."""
    check_against_reference(CupyKernels(runtime=OS_THREADS), size, n, seed, spread)


@pytest.mark.parametrize("seed", [1, 2])
def test_randomised_scheduling_gives_the_same_bits(seed):
    """OS threads that yield and sleep at random around every barrier and warp intrinsic."""
    runtime = CpuRuntime(jitter=True, seed=seed)
    check_against_reference(CupyKernels(runtime=runtime), 4000 + seed, 5, seed, 8)


@pytest.mark.parametrize("seed", [3, 4])
def test_random_fiber_orders_give_the_same_bits(seed):
    """Fibers resumed in a random order (seeded, so reproducible) over 79 blocks."""
    runtime = CpuRuntime(fibers=True, jitter=True, seed=seed)
    check_against_reference(CupyKernels(runtime=runtime), 20_000 + seed, 3, seed, 15)


def test_every_kernel_is_executed_and_grids_are_the_wrappers():
    """Every entry point but the staged step's finish_rms runs, one launch per norm (the last
    block finishes it), with the grid the wrapper computes (98 blocks for 10⁵ elements)."""
    runtime = CpuRuntime(fibers=True)
    check_against_reference(CupyKernels(runtime=runtime), 100_000, 5, 4, 3)
    assert {name for name, _, _ in runtime.launches} == ENTRIES - {"commopt_finish_rms"}
    assert all(block == (THREADS,) for _, _, block in runtime.launches)
    grids = {name: grid for name, grid, _ in runtime.launches}
    assert grids["commopt_compensate"] == (98,)  # ceil(100_000 / 4 / 256): ragged last block
    assert grids["commopt_server_average"] == (10,)  # 20_000-element chunk, 2 · 1024 per block
    assert grids["commopt_unpack_scaled"] == (10, 5)  # 2_500 bytes a row, one thread each
    per_call = [name for name, _, _ in runtime.launches]
    assert per_call[:2] == ["commopt_compensate", "commopt_pack_update"]  # no finishing kernel
    assert per_call.count("commopt_server_average") == per_call.count("commopt_pack_update") - 1


# -- the staged server step (the pipelined allreduce) ---------------------------------------------
B = SERVER_BLOCK
STAGED_CASES = {
    "one byte": (8, 1, [(0, 8)]),
    "one block": (B, 2, [(0, B)]),
    "a block and 8": (B + 8, 3, [(B, B + 8), (0, B)]),
    "pipelined 4 of 3·ALIGN+8": (3 * ALIGN + 8, 4, stage_ranges(3 * ALIGN + 8, 4)),
    "short last block": (20_000, 5, [(2 * B, 20_000), (0, B), (B, 2 * B)]),
    "block by block": (5 * B, 9, [(k * B, (k + 1) * B) for k in (3, 0, 4, 2, 1)]),
    "pipelined 3 of 40 008": (40_008, 7, stage_ranges(40_008, 3)),
}


@pytest.mark.parametrize("case", sorted(STAGED_CASES))
def test_staged_server_step_equals_server_reduce(case):
    """f, bits and t of the staged server step equal one server_reduce_ bit for bit (fibers)."""
    chunk, n, ranges = STAGED_CASES[case]
    check_server_stages(CupyKernels(runtime=FIBERS), chunk, n, seed=chunk + n, ranges=ranges)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    chunk_bytes=st.one_of(st.integers(1, 600), st.integers(1, 12_500)),
    n=st.integers(1, 9),
    stages=st.integers(1, 8),
    seed=st.integers(0, 2**32 - 1),
    spread=st.integers(0, 15),
)
def test_staged_server_step_any_size_and_order(chunk_bytes, n, stages, seed, spread):
    """Chunks of 8 … 10⁵ elements in the pipelined allreduce's stage ranges, averaged in a
    random order; magnitudes up to 1e±15 with ±0 and subnormals."""
    chunk = 8 * chunk_bytes
    ranges = stage_ranges(chunk, stages)
    order = np.random.default_rng(seed).permutation(len(ranges))
    ranges = [ranges[i] for i in order]
    check_server_stages(CupyKernels(runtime=FIBERS), chunk, n, seed, ranges, spread)


def test_staged_server_step_on_os_threads_and_random_schedules():
    ranges = [(B, 2 * B + 64), (0, B)]
    check_server_stages(CupyKernels(runtime=OS_THREADS), 2 * B + 64, 3, 5, ranges)
    for seed in (1, 2):
        runtime = CpuRuntime(fibers=True, jitter=True, seed=seed)
        check_server_stages(
            CupyKernels(runtime=runtime),
            3 * B + 8,
            4,
            seed,
            ranges=[(2 * B, 3 * B + 8), (0, B), (B, 2 * B)],
        )


def test_staged_server_step_runs_the_cuda_kernels_with_pipelined_alignment():
    runtime = CpuRuntime(fibers=True)
    kernels = CupyKernels(runtime=runtime)
    check_server_stages(kernels, 20_000, 3, 1, [(0, 2 * B), (2 * B, 20_000)])
    assert ALIGN % kernels.server_stages(torch.zeros(8)).align == 0 and B == 1024
    staged = [name for name, _, _ in runtime.launches][2:]  # after server_reduce_'s two
    assert (
        staged
        == ["commopt_server_average"] * 2 + ["commopt_finish_rms"] + ["commopt_pack_update"] * 2
    )
    # a chunk the kernels do not take goes to the reference's stages, as server_reduce_ does
    f64 = torch.zeros(16, dtype=torch.float64)
    assert type(kernels.server_stages(f64)).__name__ == "_TorchServerStages"


def test_staged_server_step_refuses_ranges_that_break_the_blocks():
    kernels = CupyKernels(runtime=FIBERS)
    n, chunk = 2, 2 * B + 8
    recv = torch.zeros(n, chunk // 8, dtype=torch.uint8)
    scales = torch.ones(n)
    stages = kernels.server_stages(torch.zeros(chunk))
    with pytest.raises(ValueError, match=r"range \[8, 1032\) .* must start at a multiple of 1024"):
        stages.average_(recv[:, : B // 8], scales, 8)
    with pytest.raises(ValueError, match=r"range \[0, 8\) .* end at one or at the end"):
        stages.average_(recv[:, :1], scales, 0)
    with pytest.raises(ValueError, match=r"range \[1024, 2064\) of a 2056-element chunk"):
        stages.average_(recv[:, : B // 8 + 2], scales, B)  # runs past the end of f
    stages.average_(recv[:, B // 8 :], scales, B)
    with pytest.raises(ValueError, match=r"\[1024, 2056\) was averaged already"):
        stages.average_(recv[:, B // 8 :], scales, B)
    with pytest.raises(ValueError, match=r"after averaging 1032 of the chunk's 2056 elements"):
        stages.scale()


@pytest.mark.parametrize(
    "grid,chunk,n,split",
    [(1, 3 * B + 8, 2, B), (2, 5 * B + 1000, 5, 2 * B), (3, 40_000, 9, 4 * B)],
)
def test_server_block_loop_wraps_and_partials_ignore_the_grid(grid, chunk, n, split):
    """Fewer CUDA blocks than element blocks, whole chunk and two ranges: the same partials."""
    check_server_grid_stride(FIBERS, grid, chunk, n, seed=grid + n, split=split)


def test_server_block_loop_wraps_on_os_threads():
    check_server_grid_stride(OS_THREADS, 1, 2 * B + 8, 3, seed=1, split=B)


# -- grid-stride loops, odd block counts -------------------------------------------------------
@pytest.mark.parametrize(
    "grid,size,n", [(1, 6000, 2), (3, 40_000, 2), (5, 60_001, 4), (7, 80_001, 4), (13, 99_999, 3)]
)
def test_grid_stride_loops_wrap(grid, size, n):
    """Grids far smaller than the data: every loop, unpack's row loop too, goes round."""
    check_grid_stride(FIBERS, grid, size, n, seed=grid * 1000 + n)


@pytest.mark.parametrize("grid,size,n", [(1, 5000, 2), (3, 13_001, 2)])
def test_grid_stride_loops_wrap_on_os_threads(grid, size, n):
    check_grid_stride(OS_THREADS, grid, size, n, seed=grid)


@pytest.mark.parametrize("count", [1, 3, 255, 256, 257, 1000, 4096])
def test_finish_rms_reduces_any_number_of_partials(count):
    """commopt_finish_rms's own stride loop (i += blockDim.x) over up to _MAX_BLOCKS partials."""
    check_finish_rms(FIBERS, count)


# -- the execution model itself --------------------------------------------------------------------
MODEL_PROBE = r"""
extern "C" __global__ void probe(const float* __restrict__ in, float* out, unsigned* ballots,
                                 unsigned* where) {
    const unsigned block = blockIdx.y * gridDim.x + blockIdx.x;
    const unsigned i = block * blockDim.x + threadIdx.x;
    where[i] = block;
    out[i] = __shfl_down_sync(0xffffffffu, in[i], 3);
    const unsigned b = __ballot_sync(0xffffffffu, in[i] < 0.0f);
    if ((threadIdx.x & 31) == 0) {
        ballots[i >> 5] = b;
    }
}
"""

DIVERGENT = r"""
extern "C" __global__ void divergent(float* v) {
    if (threadIdx.x < 16) {
        v[threadIdx.x] = __shfl_down_sync(0xffffffffu, v[threadIdx.x], 1);
    }
}
"""


@pytest.mark.parametrize("fibers", [True, False], ids=["fibers", "os-threads"])
def test_shuffle_ballot_and_indices_behave_as_on_a_gpu(fibers):
    kernel = compile_source(MODEL_PROBE, name="probe.cu", fibers=fibers).get_function("probe")
    grid, block = (3, 2), 64
    total = 3 * 2 * block
    rng = np.random.default_rng(0)
    data = rng.standard_normal(total).astype(np.float32)
    out = np.zeros(total, dtype=np.float32)
    ballots = np.zeros(total // 32, dtype=np.uint32)
    where = np.full(total, 99, dtype=np.uint32)
    kernel(grid, block, (data, out, ballots, where))
    lane = np.arange(total) % 32
    expect = np.where(lane + 3 < 32, np.roll(data, -3), data)  # lane l gets l+3, else its own
    np.testing.assert_array_equal(out, expect)
    neg = (data < 0).reshape(-1, 32)
    np.testing.assert_array_equal(ballots, (neg * (1 << np.arange(32, dtype=np.uint64))).sum(1))
    np.testing.assert_array_equal(where, np.repeat(np.arange(6), block))


@pytest.mark.parametrize("fibers", [True, False], ids=["fibers", "os-threads"])
def test_a_shuffle_with_missing_lanes_is_reported(fibers):
    kernel = compile_source(DIVERGENT, name="divergent.cu", fibers=fibers).get_function("divergent")
    with pytest.raises(KernelLaunchError, match=r"mask 0xffffffff names lanes that did not"):
        kernel((1,), (32,), (np.zeros(32, dtype=np.float32),))


def test_arguments_are_checked_against_the_c_signature():
    """What lets the wrappers' argument types count as verified: a mismatch raises."""
    kernel = FIBERS.module("worker.cu").get_function("commopt_finish_rms")
    partial, out = np.zeros(4), np.zeros(1, dtype=np.float32)
    with pytest.raises(TypeError, match=r"argument 2 is a 8-byte signed integer; got int32"):
        kernel((1,), (THREADS,), (partial, np.int64(4), np.int32(32), out))
    with pytest.raises(TypeError, match=r"argument 0 points to a 8-byte floating point"):
        kernel((1,), (THREADS,), (partial.astype(np.float32), np.int64(4), np.int64(32), out))
    with pytest.raises(TypeError, match=r"pass a numpy scalar of that width, not int"):
        kernel((1,), (THREADS,), (partial, 4, np.int64(32), out))
    with pytest.raises(TypeError, match=r"takes 4 arguments, got 3"):
        kernel((1,), (THREADS,), (partial, np.int64(4), np.int64(32)))


def test_the_compiled_text_is_exactly_cuda_source():
    """The CPU build compiles cuda_source() verbatim: the header goes before, exports after."""
    from tests.cuda_on_cpu import translation_unit

    for name in ("worker.cu", "server.cu", "unpack.cu"):  # headers pasted in: see cuda_sources
        unit, entries = translation_unit(cuda_source(name), name)
        body = unit.split(f'#line 1 "{name}"\n', 1)[1]
        assert body.startswith(cuda_source(name))
        assert set(entries) <= ENTRIES
