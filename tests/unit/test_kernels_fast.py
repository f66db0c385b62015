"""The fused CPU kernels (numba) against the reference TorchKernels and a numpy model, and dispatch.

Contract (commopt.kernels): every elementwise result is one correctly rounded fp32 operation, so
signs, packed bytes and every float must equal the reference bit for bit *given the same scales*.
The scales s and t are norms; NumbaKernels sums the squares in fp64 and rounds once, so they are
checked against an fp64 value computed here (to 1 ulp) and the downstream kernels are then fed
the same scale on both sides.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import commopt.kernels as kernels_mod
from commopt.compressed import padded_size
from commopt.kernels import SlowKernelsWarning, TorchKernels, get_kernels, use_kernels

pytest.importorskip("numba", reason="numba is not installed (the `fast` extra); nothing to test")
import commopt.kernels.numba_loops as loops
from commopt.kernels.numba_kernels import NumbaKernels

F32 = np.float32
FAST = NumbaKernels()
REF = TorchKernels()


# -- helpers written for these tests ------------------------------------------------------------
def values(rng: np.random.Generator, size: int, spread: int) -> np.ndarray:
    """fp32 values of magnitudes 10^-spread … 10^spread (≤ 1e15), ±0 and subnormals mixed in."""
    x = rng.standard_normal(size).astype(np.float64) * 10.0 ** rng.integers(
        -spread, spread + 1, size
    )
    x = x.astype(F32)
    if size:
        k = max(1, size // 20)
        x[rng.integers(0, size, k)] = F32(0.0)
        x[rng.integers(0, size, k)] = F32(-0.0)
        x[rng.integers(0, size, k)] = F32(1e-41) * rng.choice([F32(-1), F32(1)], k)  # subnormal
    return x


def exact_rms(a: np.ndarray) -> float:
    a64 = a.astype(np.float64)
    return float(np.sqrt(np.dot(a64, a64)) / np.sqrt(a.size))


def assert_within_one_ulp(value: float, exact: float) -> None:
    ulp = float(np.spacing(F32(abs(exact))))
    assert abs(float(value) - exact) <= ulp, (value, exact, ulp)


def bits_of(t: torch.Tensor) -> np.ndarray:
    """Raw bit patterns, so −0.0 ≠ +0.0 and NaN payloads count."""
    a = t.detach().numpy()
    return a.view(np.uint32) if a.dtype == F32 else a


def server_model(recv: np.ndarray, scales: np.ndarray, f: np.ndarray) -> np.ndarray:
    """c_s = (Σ_i ±s_i in rank order)/n + f, one fp32 rounding per operation (numpy)."""
    n = recv.shape[0]
    acc = np.zeros(f.size, dtype=F32)
    for i in range(n):
        pos = np.unpackbits(recv[i]).astype(bool)
        acc = acc + np.where(pos, F32(2) * scales[i] - scales[i], F32(0) - scales[i]).astype(F32)
    return (acc / F32(n) + f).astype(F32)


def t32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a, dtype=F32))


# -- property test: kernel by kernel against TorchKernels ------------------------------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    size=st.one_of(st.integers(1, 40), st.integers(1, 30_000)),
    n=st.integers(1, 9),
    seed=st.integers(0, 2**32 - 1),
    spread=st.integers(0, 15),
)
def test_fast_kernels_match_reference(size, n, seed, spread):
    rng = np.random.default_rng(seed)
    padded = padded_size(size, n)
    chunk = padded // n
    x = values(rng, size, spread)
    e0 = values(rng, padded, spread) * F32(0.01)

    # compensate: c bit for bit, s to one ulp of the fp64 value.
    c_fast, c_ref = torch.empty(padded), torch.empty(padded)
    s_fast = FAST.compensate(t32(x), t32(e0), c_fast)
    s_ref = REF.compensate(t32(x), t32(e0), c_ref)
    np.testing.assert_array_equal(bits_of(c_fast), bits_of(c_ref))
    assert s_fast.dtype == torch.float32 and s_fast.shape == (1,)
    assert_within_one_ulp(s_fast.item(), exact_rms(c_ref.numpy()))

    # pack_worker_ with the same s on both sides (both scales, in turn): bytes and e bit for bit.
    for s in (s_ref, s_fast):
        e_fast, e_ref = t32(e0), t32(e0)
        b_fast = torch.empty(padded // 8, dtype=torch.uint8)
        b_ref = torch.empty(padded // 8, dtype=torch.uint8)
        FAST.pack_worker_(c_ref.clone(), s.clone(), e_fast, b_fast)
        REF.pack_worker_(c_ref.clone(), s.clone(), e_ref, b_ref)
        np.testing.assert_array_equal(b_fast.numpy(), b_ref.numpy())
        np.testing.assert_array_equal(b_fast.numpy(), np.packbits(c_ref.numpy() >= 0))
        np.testing.assert_array_equal(bits_of(e_fast), bits_of(e_ref))

    # The pair compressed_allreduce uses, with no stored c: the same s (to an ulp) and, given
    # the same s, the same bytes and e as compensate + pack_worker_ of the reference.
    s_pair = FAST.scale(t32(x), t32(e0))
    assert_within_one_ulp(s_pair.item(), exact_rms(c_ref.numpy()))
    assert torch.equal(REF.scale(t32(x), t32(e0)), s_ref)
    e_ref = t32(e0)
    b_ref = torch.empty(padded // 8, dtype=torch.uint8)
    REF.pack_worker_(c_ref.clone(), s_pair.clone(), e_ref, b_ref)
    for kernels in (FAST, REF):
        e_pair = t32(e0)
        b_pair = torch.empty(padded // 8, dtype=torch.uint8)
        kernels.pack_compensated_(t32(x), s_pair.clone(), e_pair, b_pair)
        np.testing.assert_array_equal(b_pair.numpy(), b_ref.numpy())
        np.testing.assert_array_equal(bits_of(e_pair), bits_of(e_ref))

    # server_reduce_: rows of random bytes, scales that include 0 and repeats.
    recv = rng.integers(0, 256, (n, chunk // 8), dtype=np.uint8)
    scales = np.abs(values(rng, n, min(spread, 10))).astype(F32)
    f0 = values(rng, chunk, spread) * F32(0.01)
    f_fast, f_ref = t32(f0), t32(f0)
    sb_fast = torch.empty(chunk // 8, dtype=torch.uint8)
    sb_ref = torch.empty(chunk // 8, dtype=torch.uint8)
    t_fast = FAST.server_reduce_(torch.from_numpy(recv.copy()), t32(scales), f_fast, sb_fast)
    t_ref = REF.server_reduce_(torch.from_numpy(recv.copy()), t32(scales), f_ref, sb_ref)
    c_s = server_model(recv, scales, f0)
    np.testing.assert_array_equal(sb_fast.numpy(), sb_ref.numpy())
    np.testing.assert_array_equal(sb_fast.numpy(), np.packbits(c_s >= 0))
    assert_within_one_ulp(t_fast.item(), exact_rms(c_s))
    # f given t_fast: the reference's own error update applied to the model's c_s with t_fast.
    expect_f = t32(c_s)
    REF.pack_worker_(t32(c_s), t_fast.clone(), expect_f, torch.empty(chunk // 8, dtype=torch.uint8))
    np.testing.assert_array_equal(bits_of(f_fast), bits_of(expect_f))
    if t_fast.item() == t_ref.item():
        np.testing.assert_array_equal(bits_of(f_fast), bits_of(f_ref))

    # unpack_scaled_: same rows and scales, output of the true length L ≤ N, bit for bit.
    server_scales = np.abs(values(rng, n, min(spread, 10))).astype(F32)
    y_fast = torch.full((size,), 7.0)
    y_ref = torch.full((size,), 7.0)
    FAST.unpack_scaled_(torch.from_numpy(recv.copy()), t32(server_scales), y_fast)
    REF.unpack_scaled_(torch.from_numpy(recv.copy()), t32(server_scales), y_ref)
    np.testing.assert_array_equal(bits_of(y_fast), bits_of(y_ref))


# -- targeted cases -----------------------------------------------------------------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    size=st.integers(1, 5000),
    seed=st.integers(0, 2**31 - 1),
    spread=st.integers(0, 15),
    bound=st.sampled_from([1e-30, 0.37, 1.0, 7.2703, 1e30, 3.0e38]),
)
def test_guard_denominator_matches_reference(size, seed, spread, bound):
    """The step guard's gather-max-scatter (commopt.optim.adam): the same bits as the torch
    reference on the indexed elements, NaN and inf included, and nothing written elsewhere."""
    rng = np.random.default_rng(seed)
    m, d = values(rng, size, spread), np.abs(values(rng, size, spread))
    m[rng.integers(0, size, max(1, size // 50))] = rng.choice([np.nan, np.inf, -np.inf])
    d[rng.integers(0, size, max(1, size // 50))] = rng.choice([np.nan, np.inf, F32(0.0)])
    where = torch.from_numpy(np.sort(rng.choice(size, rng.integers(0, size + 1), replace=False)))
    start = t32(values(rng, size, spread))  # what out holds before: kept outside ``where``
    fast, ref = start.clone(), start.clone()
    FAST.guard_denominator_(fast, t32(m), t32(d), bound, where)
    REF.guard_denominator_(ref, t32(m), t32(d), bound, where)
    np.testing.assert_array_equal(bits_of(fast), bits_of(ref))
    outside = np.ones(size, dtype=bool)
    outside[where.numpy()] = False
    np.testing.assert_array_equal(bits_of(fast)[outside], bits_of(start)[outside])
    with np.errstate(over="ignore", invalid="ignore"):
        d_w, f_w = d[where.numpy()], np.abs(m[where.numpy()]) / F32(bound)
    want = np.where(np.isnan(d_w) | np.isnan(f_w), np.nan, np.maximum(d_w, f_w)).astype(F32)
    np.testing.assert_array_equal(fast.numpy()[where.numpy()], want)  # NaN == NaN here


def test_guard_denominator_without_nan_runs_compiled(monkeypatch):
    """The compiled loop answers unless a NaN is met (then the reference redoes every index)."""
    calls = []
    monkeypatch.setattr(REF, "guard_denominator_", lambda *a: calls.append(a))
    fast = NumbaKernels()
    monkeypatch.setattr(fast, "_reference", REF)
    m, d = torch.tensor([3.0, -8.0, 1.0, 0.5]), torch.tensor([1.0, 1.0, 9.0, 1.0])
    out = torch.zeros(4)
    fast.guard_denominator_(out, m, d, 2.0, torch.tensor([0, 1, 2]))
    assert out.tolist() == [1.5, 4.0, 9.0, 0.0] and not calls
    m[1] = float("nan")
    fast.guard_denominator_(out, m, d, 2.0, torch.tensor([0, 1, 2]))
    assert len(calls) == 1


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7, 12])
def test_server_division_by_any_world_size_is_exact(n):
    """a/n is a true fp32 division (not a multiply by 1/n), also for n not a power of 2."""
    rng = np.random.default_rng(n)
    chunk_bytes = 4097  # more than one 4096-element block, with a ragged last block
    recv = rng.integers(0, 256, (n, chunk_bytes), dtype=np.uint8)
    scales = (rng.random(n) * 3 + 0.1).astype(F32)
    f0 = values(rng, 8 * chunk_bytes, 2)
    f_fast = t32(f0)
    bits = torch.empty(chunk_bytes, dtype=torch.uint8)
    t = FAST.server_reduce_(torch.from_numpy(recv), t32(scales), f_fast, bits)
    c_s = server_model(recv, scales, f0)
    plus, minus = F32(2) * F32(t.item()) - F32(t.item()), F32(0) - F32(t.item())
    expect_f = (c_s - np.where(c_s >= 0, plus, minus)).astype(F32)
    np.testing.assert_array_equal(bits_of(f_fast), expect_f.view(np.uint32))


def test_signed_zeros_and_bit_order():
    c = np.array(
        [0.0, -0.0, 1.0, -1.0, -0.0, 0.0, -2.0, 2.0, -5.0, 0, 0, 0, 0, 0, 0, 3.0], dtype=F32
    )
    cc = torch.empty(16)
    s = FAST.compensate(t32(c), torch.zeros(16), cc)
    e = torch.zeros(16)
    bits = torch.empty(2, dtype=torch.uint8)
    FAST.pack_worker_(cc, s, e, bits)
    assert bits.tolist() == [0b1110_1101, 0b0111_1111]
    # ±0 count as ≥ 0: e = 0 − s exactly; the sign of a zero c never leaks into e.
    np.testing.assert_array_equal(e.numpy()[[0, 1, 4, 5]], np.full(4, -s.item(), dtype=F32))


def test_zero_buffer_gives_zero_scale_and_all_ones():
    c = torch.empty(24)
    s = FAST.compensate(torch.zeros(17), torch.zeros(24), c)
    assert s.item() == 0.0
    e = torch.ones(24)
    bits = torch.empty(3, dtype=torch.uint8)
    FAST.pack_worker_(c, s, e, bits)
    assert bits.tolist() == [255, 255, 255]
    assert torch.equal(e, torch.zeros(24))


def test_large_finite_values_give_a_finite_scale():
    """Squares of 1e20 overflow fp32; the fp64 sum does not, so s stays finite and accurate."""
    x = np.array([1e20, -3e20, 5e19, 1.0, 0.0, -1e-30, 3e38, -3e38], dtype=F32)
    s = FAST.compensate(t32(x), torch.zeros(8), torch.empty(8))
    assert np.isfinite(s.item())
    assert_within_one_ulp(s.item(), exact_rms(x))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_gives_non_finite_scale(bad):
    """compressed_allreduce relies on s being non-finite to reject the buffer before e changes."""
    x = np.ones(100, dtype=F32)
    x[37] = bad
    s = FAST.compensate(t32(x), torch.zeros(104), torch.empty(104))
    assert not np.isfinite(s.item())


def test_unusual_layouts_fall_back_to_the_reference():
    """Non-contiguous tensors go to TorchKernels instead of being misread."""
    x = torch.randn(64)[::2]  # 32 elements, stride 2
    e = torch.randn(32)
    c_fast, c_ref = torch.empty(32), torch.empty(32)
    s_fast = FAST.compensate(x, e, c_fast)
    s_ref = REF.compensate(x.contiguous(), e, c_ref)
    assert torch.equal(c_fast, c_ref) and torch.equal(s_fast, s_ref)
    out = torch.empty(32, 2)[:, 0]
    FAST.unpack_scaled_(
        torch.tensor([[0xF0], [0x0F], [0xAA], [0x55]], dtype=torch.uint8), torch.ones(4), out
    )
    expect = np.where(
        np.unpackbits(np.array([0xF0, 0x0F, 0xAA, 0x55], dtype=np.uint8)) == 1, 1.0, -1.0
    )
    np.testing.assert_array_equal(out.numpy(), expect.astype(F32))


def test_multidimensional_output_is_filled_in_order():
    bits = torch.tensor([[0b1010_0000], [0b0000_0001]], dtype=torch.uint8)
    out = torch.empty(2, 8)
    FAST.unpack_scaled_(bits, torch.tensor([2.0, 0.5]), out)
    expect = [2, -2, 2, -2, -2, -2, -2, -2] + [-0.5] * 7 + [0.5]
    assert out.reshape(-1).tolist() == expect


# -- dispatch -----------------------------------------------------------------------------------
@pytest.fixture
def fresh_dispatch():
    """Clear the dispatch caches before and after, so a faked missing library does not stick."""
    kernels_mod._cpu_fast.cache_clear()
    kernels_mod._cuda_fast.cache_clear()
    yield
    kernels_mod._cpu_fast.cache_clear()
    kernels_mod._cuda_fast.cache_clear()


def test_cpu_dispatch_prefers_numba(fresh_dispatch):
    assert get_kernels(torch.device("cpu")).name == "numba"
    assert get_kernels("cpu").name == "numba"
    assert get_kernels(torch.device("meta")).name == "torch"


def test_cpu_dispatch_falls_back_without_numba(fresh_dispatch, monkeypatch):
    monkeypatch.setitem(sys.modules, "numba", None)  # makes `import numba` raise ImportError
    monkeypatch.delitem(sys.modules, "commopt.kernels.numba_kernels", raising=False)
    monkeypatch.delitem(sys.modules, "commopt.kernels.numba_loops", raising=False)
    # Falling back is announced once per process, with its cost and the fix (issue #11.1).
    with pytest.warns(SlowKernelsWarning, match=r"numba cannot be imported.*6-8x.*pip install"):
        chosen = get_kernels("cpu")
    assert isinstance(chosen, TorchKernels)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        assert isinstance(get_kernels("cpu"), TorchKernels)
        assert [k.name for k in kernels_mod.available_kernels("cpu")] == ["torch"]


def test_cuda_dispatch_falls_back_without_cupy(fresh_dispatch, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.delitem(sys.modules, "commopt.kernels.cupy_kernels", raising=False)
    with pytest.warns(SlowKernelsWarning, match=r"CuPy cannot be imported.*commopt\[cuda\]"):
        assert isinstance(get_kernels(torch.device("cuda", 0)), TorchKernels)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(get_kernels(torch.device("cuda", 0)), TorchKernels)


def test_use_kernels_overrides_every_device(fresh_dispatch):
    with use_kernels(REF):
        assert get_kernels("cpu") is REF
        assert get_kernels(torch.device("cuda")) is REF
    assert get_kernels("cpu").name == "numba"


def test_warm_up_runs_every_kernel():
    """warm_up compiles (or loads from the cache) every loop compressed_allreduce uses."""
    FAST.warm_up()
    for fn in (
        loops.scale_sum,
        loops.pack_compensated,
        loops.pack_update,
        loops.server_average,
        loops.unpack,
        loops.guard_denominator,
    ):
        assert fn.signatures, f"{fn.__name__} was not compiled by warm_up"
