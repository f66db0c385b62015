"""The per-element kernel interface (SPEC §1, §6) against a numpy reference written here.

Every kernel set returned by ``commopt.kernels.get_kernels`` must compute each elementwise
result as one correctly rounded fp32 operation, so the checks below are bit-exact; only the two
norms (the scales s and t) are compared with a tolerance, against a float64 computation.

The reference is numpy in float32: numpy's scalar and array arithmetic on float32 is correctly
rounded per operation, which is exactly the contract of :mod:`commopt.kernels`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from commopt.compressed import padded_size
from commopt.kernels import TorchKernels, get_kernels

F32 = np.float32
# fp32 sums of 10^5 squares of mixed magnitudes drift ~1e-5 from float64 with reduction order;
# a wrong normaliser (√L for √N) would be off by ≥ 2.8e-4 even at the largest size.
NORM_RTOL = 1e-4


def _kernel_sets() -> list:
    chosen = get_kernels(torch.device("cpu"))
    sets = [chosen]
    if type(chosen) is not TorchKernels:
        sets.append(TorchKernels())
    return sets


KERNELS = _kernel_sets()
kernel_param = pytest.mark.parametrize("kernels", KERNELS, ids=[k.name for k in KERNELS])


# -- numpy reference --------------------------------------------------------------------------
def ref_sgn(a: np.ndarray) -> np.ndarray:
    """+1 where a >= 0 (both zeros included), else -1, as float32."""
    return np.where(a >= 0, F32(1), F32(-1)).astype(F32)


def ref_rms(a: np.ndarray) -> float:
    """‖a‖₂/√len(a) in float64."""
    a64 = a.astype(np.float64)
    return float(np.sqrt(np.sum(a64 * a64) / a64.size)) if a.size else 0.0


def ulp(a: np.ndarray) -> np.ndarray:
    """Spacing of float32 at |a|, as float64."""
    return np.spacing(np.abs(a).astype(F32)).astype(np.float64)


def random_buffer(rng: np.random.Generator, size: int, zeros: bool = True) -> np.ndarray:
    """Gaussian values of mixed magnitudes, with some +0.0 and -0.0 sprinkled in."""
    x = rng.standard_normal(size).astype(F32) * F32(10.0) ** rng.integers(-3, 4, size).astype(F32)
    if zeros and size:
        idx = rng.integers(0, size, max(1, size // 16))
        x[idx] = np.where(rng.random(idx.size) < 0.5, F32(0.0), F32(-0.0))
    return x.astype(F32)


def t32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=F32).copy())


def compensated(x: np.ndarray, e: np.ndarray) -> np.ndarray:
    """c = pad(x) + e: one fp32 add per true element, e itself on the pad."""
    c = e.copy()
    c[: x.size] = x + e[: x.size]
    return c


def run_worker(kernels, x: np.ndarray, e: np.ndarray, path: str = "two-step"):
    """The worker side through the kernel set; returns (c, s, new e, bits).

    ``path="two-step"``: compensate + pack_worker_ (c is the kernel's own output);
    ``path="fused"``: scale + pack_compensated_, the pair compressed_allreduce uses (c never
    leaves the kernel, so the reference c is returned).
    """
    padded = e.size
    xt, et = t32(x), t32(e)
    bits = torch.empty(padded // 8, dtype=torch.uint8)
    if path == "fused":
        s = kernels.scale(xt, et)
        assert torch.equal(et, t32(e)), "scale must not change e"
        c = compensated(x, e)
        kernels.pack_compensated_(xt, s, et, bits)
    else:
        ct = torch.empty(padded, dtype=torch.float32)
        s = kernels.compensate(xt, et, ct)
        c = ct.numpy().copy()
        kernels.pack_worker_(ct, s, et, bits)
    assert s.dtype == torch.float32 and s.numel() == 1
    assert torch.equal(xt, t32(x)), "x must not change"
    return c, F32(s.item()), et.numpy(), bits.numpy()


WORKER_PATHS = ["two-step", "fused"]
path_param = pytest.mark.parametrize("path", WORKER_PATHS)


# -- bit packing ------------------------------------------------------------------------------
@kernel_param
@path_param
def test_first_element_is_most_significant_bit(path, kernels):
    c = np.full(16, -1.0, dtype=F32)
    c[0] = 2.0  # element 0 → bit 7 of byte 0
    c[15] = 3.0  # element 15 → bit 0 of byte 1
    _, _, _, bits = run_worker(kernels, c, np.zeros(16, dtype=F32), path)
    assert bits.tolist() == [0b1000_0000, 0b0000_0001]


@kernel_param
@pytest.mark.parametrize("size", [8, 64, 1000 * 8, 8 * 4099])
@path_param
def test_bits_match_numpy_packbits(path, kernels, size):
    rng = np.random.default_rng(size)
    x = random_buffer(rng, size)
    c, _, _, bits = run_worker(kernels, x, np.zeros(size, dtype=F32), path)
    np.testing.assert_array_equal(bits, np.packbits(c >= 0))


@kernel_param
@pytest.mark.parametrize("n", [1, 2, 3, 8])
@path_param
def test_pack_unpack_round_trip(path, kernels, n):
    """unpack_scaled_ with unit scales returns sgn(c) for every element, chunk by chunk."""
    rng = np.random.default_rng(n)
    padded = padded_size(1001, n)
    c, _, _, bits = run_worker(
        kernels, random_buffer(rng, padded), np.zeros(padded, dtype=F32), path
    )
    out = torch.empty(padded)
    kernels.unpack_scaled_(torch.from_numpy(bits.copy()).view(n, -1), torch.ones(n), out)
    np.testing.assert_array_equal(out.numpy(), ref_sgn(c))


@kernel_param
@path_param
def test_signed_zeros_map_to_plus_one(path, kernels):
    c = np.array([0.0, -0.0, 1.0, -1.0, -0.0, 0.0, -2.0, 2.0], dtype=F32)
    _, s, e, bits = run_worker(kernels, c, np.zeros(8, dtype=F32), path)
    assert bits.tolist() == [0b1110_1101]
    # e = c − s·(+1) at both zeros: exactly −s, with no −0.0/+0.0 distinction involved.
    assert s > 0
    np.testing.assert_array_equal(e[[0, 1, 4, 5]], np.full(4, -s, dtype=F32))


# -- worker side ------------------------------------------------------------------------------
@kernel_param
@pytest.mark.parametrize("size,n", [(1, 1), (7, 2), (1001, 4), (4099, 3), (40_000, 8)])
def test_compensate_is_exact_and_norm_close(kernels, size, n):
    rng = np.random.default_rng(size)
    padded = padded_size(size, n)
    x = random_buffer(rng, size)
    e = random_buffer(rng, padded, zeros=False) * F32(0.1)
    c, s, _, _ = run_worker(kernels, x, e)
    expect_c = e.copy()
    expect_c[:size] = x + e[:size]  # one correctly rounded fp32 add per element
    np.testing.assert_array_equal(c, expect_c)
    assert s == pytest.approx(ref_rms(expect_c), rel=1e-5)


@kernel_param
@pytest.mark.parametrize("size,n", [(3, 1), (1001, 4), (4099, 7)])
@path_param
def test_worker_error_is_the_correctly_rounded_difference(path, kernels, size, n):
    """e == fl(c − s·sgn(c)) bit for bit, and c ≈ s·sgn(c) + e to half an ulp of e.

    ``c == s·sgn(c) + e`` cannot hold exactly in floating point in general: e is rounded once.
    """
    rng = np.random.default_rng(size + n)
    padded = padded_size(size, n)
    x = random_buffer(rng, size)
    e0 = random_buffer(rng, padded, zeros=False) * F32(0.01)
    c, s, e, bits = run_worker(kernels, x, e0, path)
    expect = (c - s * ref_sgn(c)).astype(F32)  # s·sgn is exact; one rounding in the subtraction
    np.testing.assert_array_equal(e.view(np.uint32), expect.view(np.uint32))
    residual = np.abs(c.astype(np.float64) - (np.float64(s) * ref_sgn(c) + e.astype(np.float64)))
    assert np.all(residual <= 0.5 * ulp(e)), residual.max()
    np.testing.assert_array_equal(bits, np.packbits(c >= 0))


@kernel_param
@path_param
def test_all_zero_buffer_gives_zero_scale_and_no_nan(path, kernels):
    _, s, e, bits = run_worker(kernels, np.zeros(13, dtype=F32), np.zeros(16, dtype=F32), path)
    assert s == 0.0
    assert np.all(np.isfinite(e)) and np.all(e == 0)
    assert bits.tolist() == [255, 255]


@kernel_param
@path_param
def test_tiny_and_large_finite_values_stay_finite(path, kernels):
    """Norms of finite buffers must not overflow or produce NaN (squares of 1e20 exceed fp32)."""
    x = np.array([1e-30, -1e-38, 1e20, -3e20, 0.0, 1.0, -1e-45, 5e19], dtype=F32)
    c, s, e, _ = run_worker(kernels, x, np.zeros(8, dtype=F32), path)
    assert np.isfinite(s)
    assert s == pytest.approx(ref_rms(c), rel=1e-6)
    assert np.all(np.isfinite(e))


@kernel_param
@pytest.mark.parametrize("size,n", [(5, 1), (1001, 4), (4099, 8)])
def test_fused_worker_path_equals_two_step_path(kernels, size, n):
    """Given the same s, pack_compensated_ and compensate + pack_worker_ agree bit for bit."""
    rng = np.random.default_rng(size * n)
    padded = padded_size(size, n)
    x, e = random_buffer(rng, size), random_buffer(rng, padded) * F32(0.1)
    c = torch.empty(padded)
    e_two, e_fused = t32(e), t32(e)
    s = kernels.compensate(t32(x), e_two, c)
    assert kernels.scale(t32(x), t32(e)).item() == pytest.approx(s.item(), rel=NORM_RTOL)
    bits_two = torch.empty(padded // 8, dtype=torch.uint8)
    bits_fused = torch.empty(padded // 8, dtype=torch.uint8)
    kernels.pack_worker_(c, s, e_two, bits_two)
    kernels.pack_compensated_(t32(x), s, e_fused, bits_fused)
    assert torch.equal(bits_two, bits_fused)
    assert torch.equal(e_two.view(torch.int32), e_fused.view(torch.int32))


# -- server side ------------------------------------------------------------------------------
def ref_server(recv_bits: np.ndarray, scales: np.ndarray, f: np.ndarray):
    """a = (Σ_i s_i·sgn_i)/n in rank order, one fp32 rounding per operation; c_s = a + f."""
    n = recv_bits.shape[0]
    acc = np.zeros(f.size, dtype=F32)
    for i in range(n):
        sgn_i = np.where(np.unpackbits(recv_bits[i]) == 1, F32(1), F32(-1)).astype(F32)
        acc = (acc + scales[i] * sgn_i).astype(F32)
    a = (acc / F32(n)).astype(F32)
    return (a + f).astype(F32)


@kernel_param
@pytest.mark.parametrize("n,chunk_bytes", [(1, 1), (2, 3), (4, 32), (8, 125)])
def test_server_reduce_matches_reference(kernels, n, chunk_bytes):
    rng = np.random.default_rng(n * 1000 + chunk_bytes)
    recv = rng.integers(0, 256, (n, chunk_bytes), dtype=np.uint8)
    scales = np.abs(rng.standard_normal(n)).astype(F32) + F32(0.1)
    f0 = random_buffer(rng, 8 * chunk_bytes) * F32(0.05)
    ft = t32(f0)
    bits = torch.empty(chunk_bytes, dtype=torch.uint8)
    t = kernels.server_reduce_(torch.from_numpy(recv.copy()), t32(scales), ft, bits)
    assert t.dtype == torch.float32 and t.numel() == 1
    t = F32(t.item())
    c_s = ref_server(recv, scales, f0)
    assert t == pytest.approx(ref_rms(c_s), rel=1e-5)
    np.testing.assert_array_equal(bits.numpy(), np.packbits(c_s >= 0))
    expect_f = (c_s - t * ref_sgn(c_s)).astype(F32)
    np.testing.assert_array_equal(ft.numpy().view(np.uint32), expect_f.view(np.uint32))


@kernel_param
def test_unpack_respects_chunk_boundaries_and_length(kernels):
    """Chunk j (elements j·M … (j+1)·M − 1) is scaled by t_j; nothing is written past L."""
    # n = 3 servers, 2 bytes = M = 16 elements per chunk, N = 48.
    pattern = np.array([[0xFF, 0x00], [0xF0, 0x0F], [0xAA, 0x55]], dtype=np.uint8)
    scales = np.array([0.5, 2.0, 3.25], dtype=F32)
    for length in (48, 37, 16, 17, 5, 1):
        backing = torch.full((length + 4,), 7.0)
        out = backing[:length]
        kernels.unpack_scaled_(torch.from_numpy(pattern.copy()), t32(scales), out)
        signs = np.where(np.unpackbits(pattern.reshape(-1)) == 1, F32(1), F32(-1)).astype(F32)
        expect = (np.repeat(scales, 16) * signs)[:length]
        np.testing.assert_array_equal(out.numpy(), expect)
        assert torch.equal(backing[length:], torch.full((4,), 7.0)), "wrote past L"


# -- the whole per-element pipeline, simulated for n workers in one process ------------------
def pipeline(kernels, xs: list[np.ndarray], es: list[np.ndarray], fs: list[np.ndarray], path: str):
    """Run SPEC §1 for n simulated ranks using only the kernel set (no communication)."""
    n = len(xs)
    padded = es[0].size
    chunk_bytes = padded // (8 * n)
    worker_bits, worker_scales, new_e = [], [], []
    for r in range(n):
        _, s, e, bits = run_worker(kernels, xs[r], es[r], path)
        worker_bits.append(bits.reshape(n, chunk_bytes))
        worker_scales.append(s)
        new_e.append(e)
    scales = t32(np.array(worker_scales, dtype=F32))
    server_bits, server_scales, new_f = [], [], []
    for j in range(n):
        recv = torch.from_numpy(np.stack([worker_bits[i][j] for i in range(n)]))
        ft = t32(fs[j])
        bits = torch.empty(chunk_bytes, dtype=torch.uint8)
        t = kernels.server_reduce_(recv, scales, ft, bits)
        server_bits.append(bits.numpy())
        server_scales.append(F32(t.item()))
        new_f.append(ft.numpy())
    out = torch.empty(xs[0].size)
    kernels.unpack_scaled_(
        torch.from_numpy(np.stack(server_bits)), t32(np.array(server_scales, dtype=F32)), out
    )
    return out.numpy(), new_e, new_f, worker_scales, server_scales


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    size=st.one_of(st.integers(1, 64), st.integers(1, 100_000)),
    n=st.integers(1, 8),
    seed=st.integers(0, 2**32 - 1),
    kernel_index=st.integers(0, len(KERNELS) - 1),
    path=st.sampled_from(WORKER_PATHS),
)
def test_pipeline_properties(size, n, seed, kernel_index, path):
    """For any size 1…10^5 and n 1…8: exact errors, agreeing signs, finite, right shape."""
    kernels = KERNELS[kernel_index]
    rng = np.random.default_rng(seed)
    padded = padded_size(size, n)
    assert padded % (8 * n) == 0 and size <= padded < size + 8 * n
    xs = [random_buffer(rng, size) for _ in range(n)]
    es = [random_buffer(rng, padded, zeros=False) * F32(0.01) for _ in range(n)]
    fs = [random_buffer(rng, padded // n, zeros=False) * F32(0.01) for _ in range(n)]
    y, new_e, new_f, ws, ss = pipeline(kernels, xs, es, fs, path)

    assert y.shape == (size,) and np.all(np.isfinite(y))
    for r in range(n):
        c = es[r].copy()
        c[:size] = xs[r] + es[r][:size]
        assert ws[r] == pytest.approx(ref_rms(c), rel=NORM_RTOL)
        expect_e = (c - ws[r] * ref_sgn(c)).astype(F32)
        np.testing.assert_array_equal(new_e[r].view(np.uint32), expect_e.view(np.uint32))
    # Server chunks: recompute from the worker signs with the reference.
    chunk = padded // n
    cs = [_c(xs[i], es[i], size) for i in range(n)]
    cs_all = []
    for j in range(n):
        recv = np.stack([np.packbits(cs[i][j * chunk : (j + 1) * chunk] >= 0) for i in range(n)])
        c_s = ref_server(recv, np.array(ws, dtype=F32), fs[j])
        assert ss[j] == pytest.approx(ref_rms(c_s), rel=NORM_RTOL)
        expect_f = (c_s - ss[j] * ref_sgn(c_s)).astype(F32)
        np.testing.assert_array_equal(new_f[j].view(np.uint32), expect_f.view(np.uint32))
        cs_all.append(c_s)
    expect_y = np.concatenate([ss[j] * ref_sgn(cs_all[j]) for j in range(n)])[:size]
    np.testing.assert_array_equal(y, expect_y.astype(F32))


def _c(x: np.ndarray, e: np.ndarray, size: int) -> np.ndarray:
    c = e.copy()
    c[:size] = x + e[:size]
    return c
