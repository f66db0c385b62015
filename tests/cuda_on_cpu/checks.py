"""The checks the CUDA-on-CPU tests run, as plain functions that raise AssertionError.

Kept apart from the test files so the mutation tests can run the very same checks on a broken
kernel and require them to fail.

Contract (commopt.kernels): signs, packed bytes and every float equal TorchKernels bit for bit
*given the same scales*. The scales s and t are norms, reduced in fp64 by the CUDA kernels in
their own (block, warp) order; they are checked to one ulp of an fp64 value computed here, and
the downstream kernels are then fed the same scale on both sides (as tests/gpu and
tests/unit/test_kernels_fast.py do).
"""

from __future__ import annotations

import numpy as np
import torch

from commopt.compressed import padded_size
from commopt.kernels import Kernels, TorchKernels
from tests.cuda_on_cpu import CpuRuntime

__all__ = [
    "SERVER_BLOCK",
    "THREADS",
    "assert_within_one_ulp",
    "bits_of",
    "check_against_reference",
    "check_finish_rms",
    "check_grid_stride",
    "check_server_grid_stride",
    "check_server_stages",
    "exact_rms",
    "server_model",
    "values",
]

F32 = np.float32
REF = TorchKernels()
THREADS = 256  # COMMOPT_THREADS: the block size every commopt kernel is written for
SERVER_BLOCK = 1024  # COMMOPT_SERVER_BLOCK: elements per partial sum of the server kernel


def values(rng: np.random.Generator, size: int, spread: int) -> np.ndarray:
    """fp32 values of magnitudes 10^-spread … 10^spread, with ±0 and subnormals mixed in."""
    x = rng.standard_normal(size) * 10.0 ** rng.integers(-spread, spread + 1, size)
    x = x.astype(F32)
    if size:
        k = max(1, size // 20)
        x[rng.integers(0, size, k)] = F32(0.0)
        x[rng.integers(0, size, k)] = F32(-0.0)
        x[rng.integers(0, size, k)] = F32(1e-41) * rng.choice([F32(-1), F32(1)], k)  # subnormal
    return x


def exact_rms(a: np.ndarray) -> float:
    a64 = a.astype(np.float64)
    return float(np.sqrt(np.dot(a64, a64)) / np.sqrt(max(1, a.size)))


def assert_within_one_ulp(value: float, exact: float, what: str) -> None:
    ulp = float(np.spacing(F32(abs(exact))))
    assert abs(float(value) - exact) <= ulp, f"{what}: {value!r} vs exact {exact!r} (ulp {ulp})"


def bits_of(a: torch.Tensor | np.ndarray) -> np.ndarray:
    """Raw bit patterns, so −0.0 ≠ +0.0 and NaN payloads count."""
    a = a.detach().numpy() if isinstance(a, torch.Tensor) else a
    return a.view(np.uint32) if a.dtype == F32 else a


def assert_same_bits(got, expect, what: str) -> None:
    got, expect = bits_of(got), bits_of(expect)
    if not np.array_equal(got, expect):
        bad = np.flatnonzero(got != expect)
        raise AssertionError(
            f"{what}: {bad.size} of {expect.size} elements differ, first at {bad[:5].tolist()}"
        )


def server_model(recv: np.ndarray, scales: np.ndarray, f: np.ndarray) -> np.ndarray:
    """c_s = (Σ_i ±s_i in rank order)/n + f, one fp32 rounding per operation (numpy)."""
    n = recv.shape[0]
    acc = np.zeros(f.size, dtype=F32)
    for i in range(n):
        pos = np.unpackbits(recv[i]).astype(bool)
        acc = acc + np.where(pos, F32(2) * scales[i] - scales[i], F32(0) - scales[i]).astype(F32)
    return (acc / F32(n) + f).astype(F32)


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a))


def check_against_reference(kernels: Kernels, size: int, n: int, seed: int, spread: int) -> None:
    """Every kernel of ``kernels`` against TorchKernels on one random case (SPEC §1 shapes)."""
    rng = np.random.default_rng(seed)
    padded = padded_size(size, n)
    chunk = padded // n
    x = values(rng, size, spread)
    e0 = values(rng, padded, spread) * F32(0.01)

    # compensate: c bit for bit, s to one ulp of the fp64 value.
    c, c_ref = torch.full((padded,), float("nan")), torch.empty(padded)
    s = kernels.compensate(_t(x), _t(e0), c)
    REF.compensate(_t(x), _t(e0), c_ref)
    assert_same_bits(c, c_ref, "compensate c")
    assert s.dtype == torch.float32 and s.shape == (1,)
    assert_within_one_ulp(s.item(), exact_rms(c_ref.numpy()), "compensate s")

    # pack_worker_ with the same s on both sides: bytes and e bit for bit.
    e, e_ref = _t(e0), _t(e0)
    b = torch.full((padded // 8,), 0x5A, dtype=torch.uint8)
    b_ref = torch.empty(padded // 8, dtype=torch.uint8)
    kernels.pack_worker_(c_ref.clone(), s.clone(), e, b)
    REF.pack_worker_(c_ref.clone(), s.clone(), e_ref, b_ref)
    assert_same_bits(b, b_ref, "pack_worker_ bits")
    assert_same_bits(b, np.packbits(c_ref.numpy() >= 0), "pack_worker_ bits vs np.packbits")
    assert_same_bits(e, e_ref, "pack_worker_ e")

    # The pair compressed_allreduce uses (no stored c): s to an ulp; with it, bytes and e.
    s_pair = kernels.scale(_t(x), _t(e0))
    assert_within_one_ulp(s_pair.item(), exact_rms(c_ref.numpy()), "scale s")
    e, e_ref = _t(e0), _t(e0)
    b = torch.full((padded // 8,), 0x5A, dtype=torch.uint8)
    kernels.pack_compensated_(_t(x), s_pair.clone(), e, b)
    REF.pack_compensated_(_t(x), s_pair.clone(), e_ref, b_ref)
    assert_same_bits(b, b_ref, "pack_compensated_ bits")
    assert_same_bits(e, e_ref, "pack_compensated_ e")

    # server_reduce_: rows of random bytes, scales that include 0, subnormals and repeats.
    recv = rng.integers(0, 256, (n, chunk // 8), dtype=np.uint8)
    scales = np.abs(values(rng, n, min(spread, 10))).astype(F32)
    f0 = values(rng, chunk, spread) * F32(0.01)
    f = _t(f0)
    sb = torch.full((chunk // 8,), 0x5A, dtype=torch.uint8)
    t = kernels.server_reduce_(_t(recv), _t(scales), f, sb)
    c_s = server_model(recv, scales, f0)
    assert_same_bits(sb, np.packbits(c_s >= 0), "server_reduce_ bits")
    assert_within_one_ulp(t.item(), exact_rms(c_s), "server_reduce_ t")
    expect_f = _t(c_s)  # the reference's own error update, applied with the same t
    REF.pack_worker_(_t(c_s), t.clone(), expect_f, torch.empty(chunk // 8, dtype=torch.uint8))
    assert_same_bits(f, expect_f, "server_reduce_ f")
    f_ref, sb_ref = _t(f0), torch.empty(chunk // 8, dtype=torch.uint8)
    REF.server_reduce_(_t(recv), _t(scales), f_ref, sb_ref)
    assert_same_bits(sb, sb_ref, "server_reduce_ bits vs TorchKernels")

    # unpack_scaled_: output of the true length L ≤ N, nothing written past it.
    server_scales = np.abs(values(rng, n, min(spread, 10))).astype(F32)
    backing = torch.full((size + 3,), 7.0)
    y_ref = torch.full((size,), 7.0)
    kernels.unpack_scaled_(_t(recv), _t(server_scales), backing[:size])
    REF.unpack_scaled_(_t(recv), _t(server_scales), y_ref)
    assert_same_bits(backing[:size], y_ref, "unpack_scaled_ out")
    assert_same_bits(backing[size:], np.full(3, 7.0, dtype=F32), "unpack_scaled_ past L")

    # Views at an odd offset (a gradient inside a flat buffer): no 16-byte vector access there
    # (the CPU build aborts on one), the scalar path, and the same bits.
    x_odd = torch.from_numpy(np.concatenate([np.zeros(1, dtype=F32), x]))[1:]
    assert x_odd.data_ptr() % 16, "the view must be misaligned"
    assert_same_bits(kernels.scale(x_odd, _t(e0)), s_pair, "scale s, x at an odd offset")
    e_odd, b_odd = _t(e0), torch.full((padded // 8,), 0x5A, dtype=torch.uint8)
    kernels.pack_compensated_(x_odd, s_pair.clone(), e_odd, b_odd)
    assert_same_bits(b_odd, b_ref, "pack_compensated_ bits, x at an odd offset")
    assert_same_bits(e_odd, e_ref, "pack_compensated_ e, x at an odd offset")
    out_odd = torch.full((size + 4,), 7.0)
    kernels.unpack_scaled_(_t(recv), _t(server_scales), out_odd[1 : size + 1])
    assert_same_bits(out_odd[1 : size + 1], y_ref, "unpack_scaled_ out at an odd offset")
    assert_same_bits(out_odd[size + 1 :], np.full(3, 7.0, dtype=F32), "unpack_scaled_ past L")


def _partial_sum_ok(partial: np.ndarray, exact: float, what: str) -> None:
    got = float(partial.sum())
    # Each block's fp64 sum may round differently from a sequential sum, never by 1e-12.
    assert abs(got - exact) <= 1e-12 * abs(exact) + 1e-300, f"{what}: Σpartial {got} vs {exact}"


def check_grid_stride(runtime: CpuRuntime, grid: int, size: int, n: int, seed: int) -> None:
    """Each kernel launched directly with ``grid`` blocks, far fewer than the data needs, so
    every grid-stride loop wraps (unpack's row loop too, with grid.y < n).

    The worker kernels take 4 elements per thread, the server kernel 8 per thread (two
    1024-element blocks per CUDA block), the unpack kernel one byte of a row per thread."""
    rng = np.random.default_rng(seed)
    padded = padded_size(size, n)
    chunk = padded // n
    assert grid * THREADS * 4 < size, "the worker loops must wrap"
    assert grid * THREADS < chunk // 8, "the unpack loop must wrap"
    assert grid < -(-chunk // (2 * SERVER_BLOCK)), "the server loop must wrap"
    worker = runtime.module("worker.cu")
    i64, i32 = np.int64, np.int32
    done = np.zeros(1, dtype=np.uint32)
    x = values(rng, size, 3)
    e0 = values(rng, padded, 3) * F32(0.01)
    c_ref = e0.copy()
    c_ref[:size] = x + e0[:size]
    exact_sq = float(np.dot(c_ref.astype(np.float64), c_ref.astype(np.float64)))

    c = np.full(padded, np.nan, dtype=F32)
    partial, s_c = np.full(grid, np.nan), np.full(1, np.nan, dtype=F32)
    worker.get_function("commopt_compensate")(
        (grid,), (THREADS,), (x, i64(size), e0.copy(), c, i64(padded), partial, done, s_c)
    )
    assert_same_bits(c, c_ref, f"commopt_compensate c, grid {grid}")
    _partial_sum_ok(partial, exact_sq, f"commopt_compensate, grid {grid}")
    assert_within_one_ulp(s_c[0], exact_rms(c_ref), f"commopt_compensate s, grid {grid}")
    assert done[0] == 0, f"commopt_compensate left its counter at {done[0]}"

    partial, s = np.full(grid, np.nan), np.full(1, np.nan, dtype=F32)
    worker.get_function("commopt_scale")(
        (grid,), (THREADS,), (x, i64(size), e0.copy(), i64(padded), partial, done, s)
    )
    _partial_sum_ok(partial, exact_sq, f"commopt_scale, grid {grid}")
    assert_same_bits(s, s_c, f"commopt_scale s vs commopt_compensate s, grid {grid}")
    assert done[0] == 0, f"commopt_scale left its counter at {done[0]}"
    s_finish = np.zeros(1, dtype=F32)
    worker.get_function("commopt_finish_rms")(
        (1,), (THREADS,), (partial, i64(grid), i64(padded), s_finish)
    )
    assert_same_bits(s_finish, s, f"commopt_finish_rms of {grid} partials vs the last block")

    e_ref, b_ref = _t(e0), torch.empty(padded // 8, dtype=torch.uint8)
    REF.pack_worker_(_t(c_ref), _t(s), e_ref, b_ref)
    e, bits = e0.copy(), np.full(padded // 8, 0x5A, dtype=np.uint8)
    worker.get_function("commopt_pack_update")(
        (grid,), (THREADS,), (c_ref.copy(), s, e, bits, i64(padded))
    )
    assert_same_bits(bits, b_ref.numpy(), f"commopt_pack_update bits, grid {grid}")
    assert_same_bits(e, e_ref, f"commopt_pack_update e, grid {grid}")
    e, bits = e0.copy(), np.full(padded // 8, 0x5A, dtype=np.uint8)
    worker.get_function("commopt_pack_compensated")(
        (grid,), (THREADS,), (x, i64(size), s, e, bits, i64(padded))
    )
    assert_same_bits(bits, b_ref.numpy(), f"commopt_pack_compensated bits, grid {grid}")
    assert_same_bits(e, e_ref, f"commopt_pack_compensated e, grid {grid}")

    recv = rng.integers(0, 256, (n, chunk // 8), dtype=np.uint8)
    scales = (rng.random(n) * 2).astype(F32)
    f0 = values(rng, chunk, 2) * F32(0.01)
    f, partial = f0.copy(), np.full(-(-chunk // SERVER_BLOCK), np.nan)
    t = np.full(1, np.nan, dtype=F32)
    runtime.module("server.cu").get_function("commopt_server_average")(
        (grid,), (THREADS,), (recv, scales, i32(n), i64(0), i64(chunk), f, partial, done, t)
    )
    c_s = server_model(recv, scales, f0)
    assert_same_bits(f, c_s, f"commopt_server_average c_s, grid {grid}")
    _partial_sum_ok(partial, float(np.dot(c_s.astype(np.float64), c_s)), "server partials")
    assert_within_one_ulp(t[0], exact_rms(c_s), f"commopt_server_average t, grid {grid}")
    assert done[0] == 0, f"commopt_server_average left its counter at {done[0]}"

    rows = max(1, n // 2)  # grid.y < n: the row loop wraps too
    out = np.full(size + 3, 7.0, dtype=F32)
    runtime.module("unpack.cu").get_function("commopt_unpack_scaled")(
        (grid, rows), (THREADS,), (recv, scales, i32(n), i64(chunk // 8), i64(size), out)
    )
    y_ref = torch.full((size,), 7.0)
    REF.unpack_scaled_(_t(recv), _t(scales), y_ref)
    assert_same_bits(out[:size], y_ref, f"commopt_unpack_scaled, grid ({grid}, {rows})")
    assert_same_bits(out[size:], np.full(3, 7.0, dtype=F32), "commopt_unpack_scaled past L")


def check_finish_rms(runtime: CpuRuntime, count: int) -> None:
    """commopt_finish_rms alone on ``count`` fp64 partial sums (its loop strides by blockDim.x)."""
    rng = np.random.default_rng(count)
    partial = rng.random(count) + 0.5  # comparable sizes: a skipped partial always shows
    n = 8 * count + 5
    out = np.zeros(1, dtype=np.float32)
    kernel = runtime.module("worker.cu").get_function("commopt_finish_rms")
    kernel((1,), (THREADS,), (partial, np.int64(count), np.int64(n), out))
    assert_within_one_ulp(out[0], float(np.sqrt(partial.sum()) / np.sqrt(n)), "finish_rms")


def _server_case(rng: np.random.Generator, chunk: int, n: int, spread: int):
    recv = rng.integers(0, 256, (n, chunk // 8), dtype=np.uint8)
    scales = np.abs(values(rng, n, min(spread, 10))).astype(F32)
    return recv, scales, values(rng, chunk, spread) * F32(0.01)


def check_server_stages(
    kernels: Kernels, chunk: int, n: int, seed: int, ranges: list[tuple[int, int]], spread: int = 6
) -> None:
    """``kernels.server_stages`` over ``ranges`` (averaged in the given order, packed in
    reverse) against one ``server_reduce_`` of the same chunk: f, the bits and t bit for bit.
    Then both against the CPU: the bits equal the CPU kernels' (get_kernels("cpu")), t is
    within an ulp of the fp64 norm, and f is the reference's update given that t."""
    from commopt.kernels import get_kernels

    rng = np.random.default_rng(seed)
    recv, scales, f0 = _server_case(rng, chunk, n, spread)
    f_whole = _t(f0)
    bits_whole = torch.full((chunk // 8,), 0x5A, dtype=torch.uint8)
    t_whole = kernels.server_reduce_(_t(recv), _t(scales), f_whole, bits_whole)

    f_staged = _t(f0)
    bits_staged = torch.full((chunk // 8,), 0xA5, dtype=torch.uint8)
    stages = kernels.server_stages(f_staged)
    assert all(lo % stages.align == 0 for lo, _ in ranges), (ranges, stages.align)
    for lo, hi in ranges:  # each stage's rows arrive as their own [n, (hi − lo)/8] tensor
        stages.average_(_t(recv[:, lo // 8 : hi // 8]), _t(scales), lo)
    t_staged = stages.scale()
    for lo, hi in reversed(ranges):
        stages.pack_(t_staged, lo, bits_staged[lo // 8 : hi // 8])
    where = f"chunk {chunk}, n {n}, ranges {ranges}"
    assert t_staged.dtype == torch.float32 and t_staged.shape == (1,)
    assert_same_bits(t_staged, t_whole, f"staged t vs server_reduce_ t ({where})")
    assert_same_bits(bits_staged, bits_whole, f"staged bits vs server_reduce_ bits ({where})")
    assert_same_bits(f_staged, f_whole, f"staged f vs server_reduce_ f ({where})")

    c_s = server_model(recv, scales, f0)
    assert_within_one_ulp(t_staged.item(), exact_rms(c_s), f"staged t ({where})")
    expect_f, scratch = _t(c_s), torch.empty(chunk // 8, dtype=torch.uint8)
    REF.pack_worker_(_t(c_s), t_staged.clone(), expect_f, scratch)
    assert_same_bits(f_staged, expect_f, f"staged f vs the reference given t ({where})")
    cpu = get_kernels("cpu")
    f_cpu, bits_cpu = _t(f0), torch.empty(chunk // 8, dtype=torch.uint8)
    t_cpu = cpu.server_reduce_(_t(recv), _t(scales), f_cpu, bits_cpu)
    assert_same_bits(bits_staged, bits_cpu, f"staged bits vs {cpu.name} ({where})")
    if t_cpu.item() == t_staged.item():  # the norms agree to an ulp; equal t → equal f
        assert_same_bits(f_staged, f_cpu, f"staged f vs {cpu.name} ({where})")


def check_server_grid_stride(
    runtime: CpuRuntime, grid: int, chunk: int, n: int, seed: int, split: int
) -> None:
    """``commopt_server_average`` launched directly with ``grid`` blocks, fewer than the chunk
    has element blocks (so its block loop wraps), once over the whole chunk and once as two
    ranges cut at ``split``: c_s equals the model, and every partial sum equals, bit for bit,
    the one a launch with one block per element block writes (the wrapper's grid)."""
    rng = np.random.default_rng(seed)
    blocks = -(-chunk // SERVER_BLOCK)
    assert grid < -(-blocks // 2), "the grid must be smaller than the chunk's element blocks / 2"
    assert 0 < split < chunk and split % SERVER_BLOCK == 0
    kernel = runtime.module("server.cu").get_function("commopt_server_average")
    i64, i32 = np.int64, np.int32
    null = (np.uint64(0), np.uint64(0))  # no done counter, no t: partial sums only
    recv, scales, f0 = _server_case(rng, chunk, n, 3)
    c_s = server_model(recv, scales, f0)

    f_ref, partial_ref = f0.copy(), np.full(blocks, np.nan)
    one_each = (-(-blocks // 2),)  # one CUDA block per two element blocks, as the wrapper
    kernel(
        one_each, (THREADS,), (recv, scales, i32(n), i64(0), i64(chunk), f_ref, partial_ref, *null)
    )
    assert_same_bits(f_ref, c_s, "commopt_server_average c_s, one block per element block")
    for k in range(blocks):
        part = c_s[k * SERVER_BLOCK : (k + 1) * SERVER_BLOCK].astype(np.float64)
        _partial_sum_ok(partial_ref[k : k + 1], float(np.dot(part, part)), f"server partial {k}")

    f, partial = f0.copy(), np.full(blocks, np.nan)
    kernel((grid,), (THREADS,), (recv, scales, i32(n), i64(0), i64(chunk), f, partial, *null))
    assert_same_bits(f, c_s, f"commopt_server_average c_s, grid {grid}")
    assert_same_bits(
        partial.view(np.uint64), partial_ref.view(np.uint64), f"server partials, grid {grid}"
    )

    f, partial = f0.copy(), np.full(blocks, np.nan)
    for lo, hi in ((split, chunk), (0, split)):
        rows = np.ascontiguousarray(recv[:, lo // 8 : hi // 8])
        kernel(
            (grid,), (THREADS,), (rows, scales, i32(n), i64(lo), i64(hi - lo), f, partial, *null)
        )
    assert_same_bits(f, c_s, f"commopt_server_average c_s in two ranges, grid {grid}")
    assert_same_bits(
        partial.view(np.uint64),
        partial_ref.view(np.uint64),
        f"server partials in two ranges, grid {grid}",
    )
