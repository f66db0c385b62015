"""compressed_allreduce on 4 forked gloo ranks whose per-element work runs in the CUDA kernels.

Each rank does three stateful calls (e and f carried over) with
``use_kernels(CupyKernels(runtime=CpuRuntime()))``: the real wrappers and the exact cuda/ text,
executed on the CPU (tests/cuda_on_cpu). Then it replays the same calls on the CPU path,
TorchKernels, given the same scales: s and t are fp64 reductions in the kernels' own order, so
the replay takes each rank's recorded s and t (after checking them to one ulp of an fp64 norm)
and does everything else itself. Outputs, worker and server errors must be equal bit for bit,
and the outputs identical on every rank.

The pipelined allreduce (``pipeline=3``) goes through the kernels' staged server step
(``CupyKernels.server_stages``: the server kernel on one range per stage): its outputs, errors
and every t must equal ``pipeline=1``'s with the same kernels, and the CPU replay's.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from commopt import compressed_allreduce, padded_size
from commopt.kernels import TorchKernels, use_kernels
from commopt.kernels.cupy_kernels import CupyKernels
from commopt.pipelined import stage_ranges
from tests.multirank.harness import run_ranks

if shutil.which("g++") is None:
    pytest.skip("g++ is not installed (scripts/test.sh installs it)", allow_module_level=True)

from tests.cuda_on_cpu import CpuRuntime
from tests.cuda_on_cpu.checks import assert_within_one_ulp, exact_rms

CALLS = 3
TIMEOUT = 240.0
REF = TorchKernels()


class _Recording:
    """Delegates to ``inner`` and records the scales it returns, in call order."""

    def __init__(self, inner: CupyKernels) -> None:
        self.inner, self.name = inner, f"recording {inner.name}"
        self.s: list[torch.Tensor] = []
        self.t: list[torch.Tensor] = []

    def compensate(self, x, worker_error, c):
        raise AssertionError("compressed_allreduce uses scale + pack_compensated_")

    def pack_worker_(self, c, s, worker_error, bits):
        raise AssertionError("compressed_allreduce uses scale + pack_compensated_")

    def scale(self, x, worker_error):
        s = self.inner.scale(x, worker_error)
        self.s.append(s.clone())
        return s

    def pack_compensated_(self, x, s, worker_error, bits):
        self.inner.pack_compensated_(x, s, worker_error, bits)

    def server_reduce_(self, recv_bits, scales, server_error, bits):
        t = self.inner.server_reduce_(recv_bits, scales, server_error, bits)
        self.t.append(t.clone())
        return t

    def unpack_scaled_(self, bits, scales, out):
        self.inner.unpack_scaled_(bits, scales, out)

    def server_stages(self, server_error):
        return _RecordingStages(self.inner.server_stages(server_error), self.t)


class _RecordingStages:
    """The inner kernels' staged server step, recording t like ``server_reduce_``'s."""

    def __init__(self, inner, t: list[torch.Tensor]) -> None:
        self.inner, self.t, self.align = inner, t, inner.align

    def average_(self, recv_bits, scales, lo):
        self.inner.average_(recv_bits, scales, lo)

    def scale(self):
        t = self.inner.scale()
        self.t.append(t.clone())
        return t

    def pack_(self, t, lo, bits):
        self.inner.pack_(t, lo, bits)


class _TorchWithScales:
    """TorchKernels, except that s and t are the recorded ones (each checked to one ulp)."""

    name = "torch with recorded scales"

    def __init__(self, s: list[torch.Tensor], t: list[torch.Tensor]) -> None:
        self.s, self.t = list(s), list(t)

    def scale(self, x, worker_error):
        c = worker_error.clone()
        c[: x.numel()] += x
        s = self.s.pop(0)
        assert_within_one_ulp(s.item(), exact_rms(c.numpy()), "recorded s")
        return s.clone()

    def pack_compensated_(self, x, s, worker_error, bits):
        REF.pack_compensated_(x, s, worker_error, bits)

    def server_reduce_(self, recv_bits, scales, server_error, bits):
        # TorchKernels.server_reduce_ up to t: c_s = (Σ_i ±s_i in rank order)/n + f.
        n = recv_bits.shape[0]
        acc = torch.zeros_like(server_error)
        for i in range(n):
            pos = torch.from_numpy(np.unpackbits(recv_bits[i].numpy()).astype(bool))
            acc += torch.where(pos, 2 * scales[i] - scales[i], 0 - scales[i])
        c_s = acc.div_(n).add_(server_error)
        t = self.t.pop(0)
        assert_within_one_ulp(t.item(), exact_rms(c_s.numpy()), "recorded t")
        REF.pack_worker_(c_s, t, server_error, bits)
        return t.clone()

    def unpack_scaled_(self, bits, scales, out):
        REF.unpack_scaled_(bits, scales, out)


def _calls(backend, kernels, length: int, pipeline: int = 1) -> dict[str, list[np.ndarray]]:
    n = backend.world_size
    padded = padded_size(length, n)
    e, f = torch.zeros(padded), torch.zeros(padded // n)
    record: dict[str, list[np.ndarray]] = {"y": [], "e": [], "f": []}
    with use_kernels(kernels):
        for call in range(CALLS):
            gen = torch.Generator().manual_seed(1000 * backend.rank + call)
            x = torch.randn(length, generator=gen) * 10.0 ** (call - 1) + 0.1 * backend.rank
            y = compressed_allreduce(x, e, f, backend, pipeline=pipeline)
            record["y"].append(y.numpy().copy())
            record["e"].append(e.numpy().copy())
            record["f"].append(f.numpy().copy())
    return record


def _cuda_then_cpu(backend, length: int, fibers: bool) -> dict:
    runtime = CpuRuntime(fibers=fibers)
    cuda = _Recording(CupyKernels(runtime=runtime))
    on_cuda = _calls(backend, cuda, length)
    on_cpu = _calls(backend, _TorchWithScales(cuda.s, cuda.t), length)
    return {"cuda": on_cuda, "cpu": on_cpu, "kernels": {name for name, _, _ in runtime.launches}}


@pytest.mark.parametrize(
    "fibers,length", [(True, 50_001), (True, 5), (False, 3_001)], ids=["fibers", "tiny", "threads"]
)
def test_compressed_allreduce_through_the_cuda_kernels_equals_the_cpu_path(fibers, length):
    runtime = CpuRuntime(fibers=fibers)
    for source in ("worker.cu", "server.cu", "unpack.cu"):
        runtime.module(source)  # compile once here, before the ranks fork
    per_rank = run_ranks(_cuda_then_cpu, 4, length, fibers, timeout=TIMEOUT)
    for rank, result in enumerate(per_rank):
        assert result["kernels"] == {  # s and t finished in the kernels' last blocks
            "commopt_scale",
            "commopt_pack_compensated",
            "commopt_server_average",
            "commopt_pack_update",
            "commopt_unpack_scaled",
        }, f"rank {rank} did not run every kernel compressed_allreduce needs on the CUDA path"
        for key in ("y", "e", "f"):
            for call in range(CALLS):
                got = result["cuda"][key][call].view(np.uint32)
                expect = result["cpu"][key][call].view(np.uint32)
                assert np.array_equal(got, expect), (
                    f"rank {rank}, call {call}: {key} differs between the CUDA kernels and the "
                    f"CPU path at {np.flatnonzero(got != expect)[:5]}"
                )
    for call in range(CALLS):
        y0 = per_rank[0]["cuda"]["y"][call].view(np.uint32)
        for rank in range(1, 4):
            assert np.array_equal(per_rank[rank]["cuda"]["y"][call].view(np.uint32), y0), (
                f"call {call}: rank {rank}'s output differs from rank 0's"
            )


# 4 ranks, N = 36 768: server chunks of 9192 elements, which pipeline=3 cuts into 3 stages,
# [0, 4096), [4096, 8192) and [8192, 9192): the last 1000 elements (a short 1024-element block).
PIPELINED_LENGTH = 4 * (2 * 4096 + 1000) - 3
STAGES = 3


def _staged_unstaged_cpu(backend) -> dict:
    staged_runtime = CpuRuntime(fibers=True)
    staged = _Recording(CupyKernels(runtime=staged_runtime))
    unstaged = _Recording(CupyKernels(runtime=CpuRuntime(fibers=True)))
    on_staged = _calls(backend, staged, PIPELINED_LENGTH, pipeline=STAGES)
    on_unstaged = _calls(backend, unstaged, PIPELINED_LENGTH, pipeline=1)
    on_cpu = _calls(backend, _TorchWithScales(staged.s, staged.t), PIPELINED_LENGTH)
    averages = sum(name == "commopt_server_average" for name, _, _ in staged_runtime.launches)
    return {
        "staged": on_staged,
        "unstaged": on_unstaged,
        "cpu": on_cpu,
        "t": [torch.cat(staged.t).numpy(), torch.cat(unstaged.t).numpy()],
        "averages": averages,
    }


def test_pipelined_allreduce_with_the_staged_cuda_server_step():
    """compressed_allreduce(pipeline=3) with the CUDA kernels' staged server step equals
    pipeline=1 with the same kernels (outputs, e, f and every t bit for bit) and the CPU path
    given the same scales, on every rank; and the server kernel ran once per stage."""
    assert len(stage_ranges(padded_size(PIPELINED_LENGTH, 4) // 4, STAGES)) == STAGES
    runtime = CpuRuntime(fibers=True)
    for source in ("worker.cu", "server.cu", "unpack.cu"):
        runtime.module(source)  # compile once here, before the ranks fork
    per_rank = run_ranks(_staged_unstaged_cpu, 4, timeout=TIMEOUT)
    for rank, result in enumerate(per_rank):
        assert result["averages"] == STAGES * CALLS, f"rank {rank}: the server was not staged"
        staged_t, unstaged_t = result["t"]
        assert np.array_equal(staged_t.view(np.uint32), unstaged_t.view(np.uint32)), (
            f"rank {rank}: t staged {staged_t} vs whole chunk {unstaged_t}"
        )
        for other in ("unstaged", "cpu"):
            for key in ("y", "e", "f"):
                for call in range(CALLS):
                    got = result["staged"][key][call].view(np.uint32)
                    expect = result[other][key][call].view(np.uint32)
                    assert np.array_equal(got, expect), (
                        f"rank {rank}, call {call}: {key} of the staged CUDA path differs from "
                        f"the {other} path at {np.flatnonzero(got != expect)[:5]}"
                    )
    for call in range(CALLS):
        y0 = per_rank[0]["staged"]["y"][call].view(np.uint32)
        for rank in range(1, 4):
            assert np.array_equal(per_rank[rank]["staged"]["y"][call].view(np.uint32), y0)
