"""The CuPy-compiled CUDA kernels (cuda/*.cu) against the CPU kernels, kernel by kernel.

Runs only where a CUDA GPU and CuPy are present; elsewhere every test here is skipped with the
reason. Contract (commopt.kernels): signs, packed bytes and every float bit for bit given the
same scales; the scales s and t are fp64 reductions on both sides and may differ by one ulp.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible to torch", allow_module_level=True)
pytest.importorskip("cupy", reason="CuPy is not installed (the `cuda` extra)")

from commopt.compressed import padded_size
from commopt.kernels import TorchKernels, get_kernels
from commopt.kernels.cupy_kernels import CupyKernels

F32 = np.float32
GPU = CupyKernels()
CPU = TorchKernels()
CPU_FAST = get_kernels("cpu")  # NumbaKernels where numba is installed
DEV = torch.device("cuda")


def values(rng: np.random.Generator, size: int, spread: int = 3) -> np.ndarray:
    x = rng.standard_normal(size) * 10.0 ** rng.integers(-spread, spread + 1, size)
    x = x.astype(F32)
    if size:
        x[rng.integers(0, size, max(1, size // 20))] = F32(-0.0)
        x[rng.integers(0, size, max(1, size // 20))] = F32(0.0)
    return x


def exact_rms(a: np.ndarray) -> float:
    a64 = a.astype(np.float64)
    return float(np.sqrt(np.dot(a64, a64)) / np.sqrt(a.size))


def within_one_ulp(value: float, exact: float) -> bool:
    return abs(float(value) - exact) <= float(np.spacing(F32(abs(exact))))


def raw(t: torch.Tensor) -> np.ndarray:
    a = t.detach().cpu().numpy()
    return a.view(np.uint32) if a.dtype == F32 else a


def cpu_and_gpu(a: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(np.array(a))
    return t, t.to(DEV)


def test_dispatch_picks_cupy_for_cuda_tensors():
    assert isinstance(get_kernels(DEV), CupyKernels)


CASES = [(1, 1), (37, 2), (1000, 3), (4099, 4), (100_003, 5), (1 << 20, 8), ((1 << 22) + 11, 7)]


@pytest.mark.parametrize("size,n", CASES)
def test_worker_kernels_match_cpu(size, n):
    rng = np.random.default_rng(size * 31 + n)
    padded = padded_size(size, n)
    x_cpu, x_gpu = cpu_and_gpu(values(rng, size))
    e_cpu, e_gpu = cpu_and_gpu(values(rng, padded) * F32(0.01))
    c_cpu, c_gpu = torch.empty(padded), torch.empty(padded, device=DEV)
    CPU.compensate(x_cpu, e_cpu.clone(), c_cpu)
    s_gpu = GPU.compensate(x_gpu, e_gpu.clone(), c_gpu)
    assert s_gpu.device.type == "cuda" and s_gpu.dtype == torch.float32 and s_gpu.shape == (1,)
    np.testing.assert_array_equal(raw(c_gpu), raw(c_cpu))
    assert within_one_ulp(s_gpu.item(), exact_rms(c_cpu.numpy()))
    # The CPU fast path reduces in fp64 too: the two scales agree to an ulp.
    s_fast = CPU_FAST.compensate(x_cpu, e_cpu.clone(), torch.empty(padded))
    assert within_one_ulp(s_gpu.item(), s_fast.item())

    # Same s on both sides: bytes and e bit for bit.
    s = s_gpu.cpu()
    b_cpu = torch.empty(padded // 8, dtype=torch.uint8)
    b_gpu = torch.empty(padded // 8, dtype=torch.uint8, device=DEV)
    CPU.pack_worker_(c_cpu, s, e_cpu, b_cpu)
    GPU.pack_worker_(c_gpu, s.to(DEV), e_gpu, b_gpu)
    np.testing.assert_array_equal(raw(b_gpu), raw(b_cpu))
    np.testing.assert_array_equal(raw(e_gpu), raw(e_cpu))


@pytest.mark.parametrize("size,n", CASES)
def test_scale_and_pack_compensated_match_cpu(size, n):
    """The pair compressed_allreduce uses (no stored c) against the CPU reference pair."""
    rng = np.random.default_rng(size * 17 + n)
    padded = padded_size(size, n)
    x_cpu, x_gpu = cpu_and_gpu(values(rng, size))
    e_cpu, e_gpu = cpu_and_gpu(values(rng, padded) * F32(0.01))
    c = e_cpu.clone()
    c[:size] += x_cpu
    s_gpu = GPU.scale(x_gpu, e_gpu)
    assert s_gpu.device.type == "cuda" and s_gpu.shape == (1,)
    assert within_one_ulp(s_gpu.item(), exact_rms(c.numpy()))
    s = s_gpu.cpu()
    b_cpu = torch.empty(padded // 8, dtype=torch.uint8)
    b_gpu = torch.empty(padded // 8, dtype=torch.uint8, device=DEV)
    CPU.pack_compensated_(x_cpu, s, e_cpu, b_cpu)
    GPU.pack_compensated_(x_gpu, s.to(DEV), e_gpu, b_gpu)
    np.testing.assert_array_equal(raw(b_gpu), raw(b_cpu))
    np.testing.assert_array_equal(raw(e_gpu), raw(e_cpu))


@pytest.mark.parametrize(
    "n,chunk_bytes", [(1, 1), (2, 3), (3, 4097), (4, 1 << 17), (7, 5001), (16, 999)]
)
def test_server_kernel_matches_cpu(n, chunk_bytes):
    rng = np.random.default_rng(n * 7919 + chunk_bytes)
    recv = rng.integers(0, 256, (n, chunk_bytes), dtype=np.uint8)
    scales = (rng.random(n) * 2).astype(F32)
    f0 = values(rng, 8 * chunk_bytes) * F32(0.01)
    r_cpu, r_gpu = cpu_and_gpu(recv)
    s_cpu, s_gpu = cpu_and_gpu(scales)
    f_cpu, f_gpu = cpu_and_gpu(f0)
    b_cpu = torch.empty(chunk_bytes, dtype=torch.uint8)
    b_gpu = torch.empty(chunk_bytes, dtype=torch.uint8, device=DEV)
    t_cpu = CPU.server_reduce_(r_cpu, s_cpu, f_cpu, b_cpu)
    t_gpu = GPU.server_reduce_(r_gpu, s_gpu, f_gpu, b_gpu)
    np.testing.assert_array_equal(raw(b_gpu), raw(b_cpu))
    # c_s from the CPU reference path, to judge t and f independently of its fp32 norm.
    f_cs = torch.from_numpy(f0.copy())
    acc = torch.zeros(8 * chunk_bytes)
    for i in range(n):
        pos = torch.from_numpy(np.unpackbits(recv[i]).astype(bool))
        acc += torch.where(pos, 2 * s_cpu[i] - s_cpu[i], 0 - s_cpu[i])
    c_s = acc / n + f_cs
    assert within_one_ulp(t_gpu.item(), exact_rms(c_s.numpy()))
    expect_f = c_s.clone()
    CPU.pack_worker_(c_s, t_gpu.cpu(), expect_f, torch.empty(chunk_bytes, dtype=torch.uint8))
    np.testing.assert_array_equal(raw(f_gpu), raw(expect_f))
    if t_gpu.item() == t_cpu.item():
        np.testing.assert_array_equal(raw(f_gpu), raw(f_cpu))


@pytest.mark.parametrize(
    "n,chunk,stages", [(1, 8, 1), (3, 3 * 4096 + 8, 4), (4, 1 << 20, 3), (7, 40_008, 3)]
)
def test_staged_server_step_equals_server_reduce(n, chunk, stages):
    """server_stages (the pipelined allreduce's server step) against one server_reduce_ on the
    GPU: f, bits and t bit for bit, ranges averaged in reverse order; bits equal the CPU's."""
    from commopt.pipelined import stage_ranges

    rng = np.random.default_rng(n * 31 + chunk)
    recv = torch.from_numpy(rng.integers(0, 256, (n, chunk // 8), dtype=np.uint8)).to(DEV)
    scales = torch.from_numpy((rng.random(n) * 2).astype(F32)).to(DEV)
    f0 = torch.from_numpy(values(rng, chunk) * F32(0.01)).to(DEV)
    f_whole, bits_whole = f0.clone(), torch.empty(chunk // 8, dtype=torch.uint8, device=DEV)
    t_whole = GPU.server_reduce_(recv, scales, f_whole, bits_whole)
    f_staged, bits_staged = f0.clone(), torch.empty(chunk // 8, dtype=torch.uint8, device=DEV)
    server = GPU.server_stages(f_staged)
    ranges = stage_ranges(chunk, stages)
    for lo, hi in reversed(ranges):
        server.average_(recv[:, lo // 8 : hi // 8].contiguous(), scales, lo)
    t_staged = server.scale()
    for lo, hi in ranges:
        server.pack_(t_staged, lo, bits_staged[lo // 8 : hi // 8])
    np.testing.assert_array_equal(raw(t_staged), raw(t_whole))
    np.testing.assert_array_equal(raw(bits_staged), raw(bits_whole))
    np.testing.assert_array_equal(raw(f_staged), raw(f_whole))
    f_cpu, bits_cpu = f0.cpu(), torch.empty(chunk // 8, dtype=torch.uint8)
    CPU_FAST.server_reduce_(recv.cpu(), scales.cpu(), f_cpu, bits_cpu)
    np.testing.assert_array_equal(raw(bits_staged), raw(bits_cpu))


@pytest.mark.parametrize(
    "n,chunk_bytes,length", [(1, 2, 16), (3, 2, 37), (4, 4097, 4 * 8 * 4097 - 5), (8, 999, 1)]
)
def test_unpack_kernel_matches_cpu(n, chunk_bytes, length):
    rng = np.random.default_rng(length)
    bits = rng.integers(0, 256, (n, chunk_bytes), dtype=np.uint8)
    scales = (rng.random(n) * 2).astype(F32)
    b_cpu, b_gpu = cpu_and_gpu(bits)
    s_cpu, s_gpu = cpu_and_gpu(scales)
    out_cpu = torch.full((length,), 7.0)
    backing = torch.full((length + 5,), 7.0, device=DEV)
    CPU.unpack_scaled_(b_cpu, s_cpu, out_cpu)
    GPU.unpack_scaled_(b_gpu, s_gpu, backing[:length])
    np.testing.assert_array_equal(raw(backing[:length]), raw(out_cpu))
    assert torch.equal(backing[length:].cpu(), torch.full((5,), 7.0)), "wrote past L"


def test_kernels_run_on_torchs_current_stream():
    """Kernels queued on a side stream wait for the torch work before them on that stream.

    The producer is held back by a ~50 ms spin on the side stream; kernels launched on any other
    stream would read ``big`` before it is written.
    """
    rng = np.random.default_rng(0)
    size = 1 << 22
    x = torch.from_numpy(values(rng, size)).to(DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        big = torch.empty_like(x).fill_(float("nan"))
        torch.cuda._sleep(100_000_000)
        big.copy_(x * 3)
        e = torch.zeros(size, device=DEV)
        c = torch.empty(size, device=DEV)
        s = GPU.compensate(big, e, c)
        bits = torch.empty(size // 8, dtype=torch.uint8, device=DEV)
        GPU.pack_worker_(c, s, e, bits)
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()
    expect = np.packbits((x * 3).cpu().numpy() >= 0)
    np.testing.assert_array_equal(bits.cpu().numpy(), expect)
    assert within_one_ulp(s.item(), exact_rms((x * 3).cpu().numpy()))


def test_no_kernel_call_synchronises_the_host():
    """Every CupyKernels call under torch's sync debug mode "error": a host synchronisation
    (a .item(), a blocking copy, a stream sync) anywhere in a call raises. Views at odd offsets
    included (the scalar path)."""
    rng = np.random.default_rng(5)
    n, size = 4, 100_003
    padded = padded_size(size, n)
    chunk = padded // n
    x = torch.from_numpy(values(rng, size + 1)).to(DEV)[1:]  # misaligned view
    e = torch.zeros(padded, device=DEV)
    c = torch.empty(padded, device=DEV)
    bits = torch.empty(padded // 8, dtype=torch.uint8, device=DEV)
    recv = torch.randint(0, 256, (n, chunk // 8), dtype=torch.uint8, device=DEV)
    scales = torch.rand(n, device=DEV) + 0.5
    f = torch.zeros(chunk, device=DEV)
    server_bits = torch.empty(chunk // 8, dtype=torch.uint8, device=DEV)
    out = torch.empty(size, device=DEV)
    GPU.scale(x, e)  # compile and allocate the workspace outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        first = GPU.scale(x, e)  # e is still 0: s = ‖pad(x)‖/√N
        for _ in range(3):  # the workspace's counter is back at 0 after every call
            s = GPU.scale(x, e)
            GPU.compensate(x, e, c)
            GPU.pack_worker_(c, s, e, bits)
            GPU.pack_compensated_(x, s, e, bits)
            t = GPU.server_reduce_(recv, scales, f, server_bits)
            stages = GPU.server_stages(f)
            stages.average_(recv, scales, 0)
            stages.pack_(stages.scale(), 0, server_bits)
            GPU.unpack_scaled_(recv, scales, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    padded_x = np.concatenate([x.cpu().numpy(), np.zeros(padded - size, dtype=F32)])
    assert within_one_ulp(first.item(), exact_rms(padded_x))
    assert torch.isfinite(t).all() and torch.isfinite(s).all()
