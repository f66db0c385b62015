"""The pipelined compressed allreduce (commopt.pipelined) equals the unpipelined one bit for bit.

On 2, 3 and 4 forked gloo ranks, each rank runs the same sequence of calls twice, once with
``pipeline=1`` and once staged, with separate error buffers, and returns outputs, e and f after
every call: they must have the same bits, for the numba kernels, the reference TorchKernels and
a kernel set without ``server_stages`` (the whole-chunk fallback), and the CUDA kernels run on
the CPU (their own staged server step). Sizes include odd ones and ones not divisible by
8·n·stages. The bytes counted must be the same, in 2·stages + 3 messages. Errors (non-finite
input, different lengths) are raised on every rank before anything changes, as unpipelined.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from commopt import NonFiniteError, compressed_allreduce, padded_size
from commopt.comm import SingleProcessBackend
from commopt.exchange import FlatExchange, HierarchicalExchange
from commopt.kernels import TorchKernels, get_kernels, use_kernels
from commopt.pipelined import ALIGN, MAX_STAGES, MIN_STAGE, auto_stages, stage_ranges
from tests.multirank.harness import run_ranks

TIMEOUT = 240.0
CALLS = 3


class _NoStages:
    """A kernel set without ``server_stages``: the whole-chunk fallback."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = f"{inner.name}-nostages"

    def __getattr__(self, name: str):
        if name == "server_stages":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _kernel_sets(cuda_on_cpu: bool = False) -> dict:
    fast = get_kernels("cpu")
    sets = {"default": fast, "nostages": _NoStages(fast)}
    if fast.name != "torch":
        sets["torch"] = TorchKernels()
    if cuda_on_cpu:  # the CUDA kernels' text executed on the CPU (tests/cuda_on_cpu)
        from commopt.kernels.cupy_kernels import CupyKernels
        from tests.cuda_on_cpu import CpuRuntime

        sets = {"cupy": CupyKernels(runtime=CpuRuntime(fibers=True))}
    return sets


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _x(rank: int, call: int, length: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7 * rank + 1000 * call + length)
    return torch.randn(length, generator=gen) * (1 + rank) + 0.1 * call


def _same_sequence(
    backend, lengths: list[int], stages: list[int | None], cuda_on_cpu: bool = False
) -> list[str]:
    """Returns the mismatches found on this rank (empty when all bits agree)."""
    n = backend.world_size
    bad = []
    for kname, kernels in _kernel_sets(cuda_on_cpu).items():
        with use_kernels(kernels):
            for length in lengths:
                padded = padded_size(length, n)
                for p in stages:
                    runs = {}
                    for mode in (1, p):
                        e, f = torch.zeros(padded), torch.zeros(padded // n)
                        rec, nbytes, calls = [], 0, 0
                        for call in range(CALLS):
                            x = _x(backend.rank, call, length)
                            before = backend.stats.snapshot()
                            if call == CALLS - 1:  # in place, as the optimizers call it
                                y = compressed_allreduce(x, e, f, backend, out=x, pipeline=mode)
                            else:
                                y = compressed_allreduce(x, e, f, backend, pipeline=mode)
                            delta = backend.stats - before
                            nbytes += delta.bytes_sent
                            calls += delta.calls
                            rec.append((_bits(y), _bits(e), _bits(f)))
                        runs[mode] = (rec, nbytes, calls)
                    (ref, ref_bytes, ref_calls), (got, got_bytes, got_calls) = runs[1], runs[p]
                    where = f"{kname} L={length} pipeline={p}"
                    if got != ref:
                        bad.append(f"{where}: results differ")
                    if got_bytes != ref_bytes:
                        bad.append(f"{where}: {got_bytes} bytes vs {ref_bytes}")
                    k = len(stage_ranges(padded // n, p or auto_stages(padded, n)))
                    if k > 1 and got_calls != ref_calls + CALLS * (2 * k - 2):
                        bad.append(f"{where}: {got_calls} calls vs {ref_calls} + 2·({k}−1)·{CALLS}")
    return bad


def _lengths(n: int) -> list[int]:
    return [
        3 * ALIGN * n + 5,  # odd; 4 stages asked, 3 ranges of ALIGN, the pad in the last
        8 * n * 5 * ALIGN - 3,  # just below a multiple of 8·n·stages
        100_003,  # prime
        2 * ALIGN * n,  # exactly two ALIGN ranges per chunk
    ]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_pipelined_equals_unpipelined(world_size: int) -> None:
    bad = run_ranks(_same_sequence, world_size, _lengths(world_size), [2, 3, 4], timeout=TIMEOUT)
    assert bad == [[]] * world_size


def test_auto_pipelines_a_large_buffer_bit_identically() -> None:
    length = 2 * MIN_STAGE + 3  # the default pipeline=None picks 2 stages here
    assert auto_stages(padded_size(length, 2), 2) == 2
    bad = run_ranks(_same_sequence, 2, [length], [None], timeout=TIMEOUT)
    assert bad == [[], []]


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed (scripts/test.sh)")
def test_pipelined_equals_unpipelined_with_the_cuda_kernels_run_on_cpu() -> None:
    # Two stages per chunk (ALIGN + 8 + …): the emulated CUDA threads are slow.
    bad = run_ranks(_same_sequence, 3, [3 * (ALIGN + 8) + 5], [2], True, timeout=TIMEOUT)
    assert bad == [[]] * 3


def test_stage_geometry() -> None:
    assert auto_stages(MIN_STAGE - 8, 4) == 1 and auto_stages(16 * 2**20, 4) == 4
    assert auto_stages(10**9, 4) == MAX_STAGES and auto_stages(10**9, 1) == 1
    assert stage_ranges(3 * ALIGN + 8, 4) == [
        (0, ALIGN),
        (ALIGN, 2 * ALIGN),
        (2 * ALIGN, 3 * ALIGN),
        (3 * ALIGN, 3 * ALIGN + 8),
    ]
    assert stage_ranges(100, 3) == [(0, 100)]  # ranges are at least ALIGN long
    assert stage_ranges(10 * ALIGN, 3) == [
        (0, 4 * ALIGN),
        (4 * ALIGN, 8 * ALIGN),
        (8 * ALIGN, 10 * ALIGN),
    ]
    with pytest.raises(ValueError, match="stage count"):
        stage_ranges(ALIGN, 0)


def _errors(backend, stages: int) -> dict:
    n, rank = backend.world_size, backend.rank
    length = 3 * ALIGN * n + 5
    padded = padded_size(length, n)
    e = torch.arange(padded, dtype=torch.float32) * 1e-3 * (rank + 1)
    f = torch.arange(padded // n, dtype=torch.float32) * -1e-3
    e0, f0 = e.clone(), f.clone()
    got = {}
    x = _x(rank, 0, length)
    if rank == n - 1:
        x[length // 2] = float("nan")
    try:
        compressed_allreduce(x, e, f, backend, pipeline=stages)
    except NonFiniteError as err:
        got["nonfinite"] = err.ranks
    mine = length + (ALIGN if rank == 0 else 0)
    e2, f2 = torch.zeros(padded_size(mine, n)), torch.zeros(padded_size(mine, n) // n)
    try:
        compressed_allreduce(_x(rank, 1, mine), e2, f2, backend, pipeline=stages)
    except ValueError as err:
        got["length"] = str(err)
    got["untouched"] = torch.equal(e, e0) and torch.equal(f, f0)
    got["untouched2"] = not bool(e2.any()) and not bool(f2.any())
    return got


@pytest.mark.parametrize("world_size", [2, 4])
def test_errors_are_raised_on_every_rank_with_buffers_untouched(world_size: int) -> None:
    for got in run_ranks(_errors, world_size, 3, timeout=TIMEOUT):
        assert got["nonfinite"] == [world_size - 1]
        assert "every rank must pass the same number of elements" in got["length"]
        assert got["untouched"] and got["untouched2"]


def _bad_pipeline(backend) -> list[str]:
    x, e, f = torch.ones(16), torch.zeros(16), torch.zeros(8)
    msgs = []
    for p in (0, -2, True):
        try:
            compressed_allreduce(x, e, f, backend, pipeline=p)
        except ValueError as err:
            msgs.append(str(err))
    return msgs


def test_bad_pipeline_argument_is_refused() -> None:
    for msgs in run_ranks(_bad_pipeline, 2, timeout=TIMEOUT):
        assert len(msgs) == 3 and all("stage count >= 1" in m for m in msgs)


def test_the_exchanges_refuse_a_bad_pipeline_argument_when_built() -> None:
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match=f"stage count >= 1 or None, got {bad!r}"):
            FlatExchange(SingleProcessBackend(), pipeline=bad)
        with pytest.raises(ValueError, match=f"stage count >= 1 or None, got {bad!r}"):
            HierarchicalExchange(SingleProcessBackend(), pipeline=bad)
