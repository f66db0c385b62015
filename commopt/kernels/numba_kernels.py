r"""The per-element work of the compressed allreduce on CPU, fused and JIT-compiled with numba.

Same results as :class:`~commopt.kernels.TorchKernels` (SPEC §1, §6), in fewer passes over memory.
Each kernel walks its buffers in blocks of 4096 elements; whatever one loop leaves for the next
(flags, partial sums) lives in a 4 KB–16 KB scratch that stays in L1, never in an N-sized
temporary:

- ``compensate``: one pass reads x and e, writes c = pad(x) + e and sums c² (fp64) on the way.
- ``pack_worker_``: per block, the flags c ≥ 0 (one byte each) are folded into packed bytes,
  MSB first, with one 64-bit multiply per byte; then e ← c − s·sgn(c).
- ``server_reduce_``: per block of the server chunk and per worker row i, the received bytes are
  spread to flags (one multiply and one mask per byte) and ±s_i is added into a block
  accumulator, in rank order; so the n·(N/n) unpacked values never exist. c_s = a/n + f goes
  straight into f (with Σ c_s²), then the worker's pack-and-update pass runs in place on f, with t.
- ``unpack_scaled_``: bytes spread to flags, then ±t_j straight into the output, block by block.

Exactness. Every elementwise value is computed with the reference's own fp32 operations in the
same order: ±s as 2s·b − s (the reference multiplies the 0/1 sign by 2s and subtracts s),
a = (((0 + v₀) + v₁) + …)/n, c_s = a + f, e = c − (±s). numba compiles fp32 arithmetic to
single IEEE operations and only the sums of squares may be reassociated (``fastmath={"reassoc"}``
on those loops alone), so the signs, the bytes and every float equal the reference's bit for bit
given the same scales. Only s and t differ: here the squares are summed in fp64 (exact squares,
any order) and √(Σc²)/√N is rounded once to fp32, within an ulp of the exact value, where the
reference's fp32 reduction drifts by thousands of ulps at 16M elements.

Compilation happens on first use (``cache=True``, so later processes load it from disk); ranks are
processes already, so the loops are single-threaded (``parallel=False``).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from commopt.kernels.torch_kernels import TorchKernels

__all__ = ["NumbaKernels"]

# Elements per block of the fused loops: 16 KB of fp32, so a block written by one loop is still
# in L1 when the next loop over the same block reads it.
_BLOCK = 4096

_jit = numba.njit(cache=True, nogil=True, error_model="numpy")
_jit_sum = numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"})


@_jit_sum
def _compensate(x, e, c):  # pragma: no cover - compiled
    """c[:L] = x + e; c[L:] = e[L:]; returns Σ c² (fp64, summed in any order)."""
    n_true = x.size
    acc = 0.0
    for i in range(n_true):
        v = x[i] + e[i]
        c[i] = v
        d = np.float64(v)
        acc += d * d
    pad_e = e[n_true:]
    pad_c = c[n_true:]
    for i in range(pad_c.size):
        v = pad_e[i]
        pad_c[i] = v
        d = np.float64(v)
        acc += d * d
    return acc


@_jit_sum
def _sum_squares(a):  # pragma: no cover - compiled
    """Σ a² in fp64, summed in any order."""
    acc = 0.0
    for i in range(a.size):
        d = np.float64(a[i])
        acc += d * d
    return acc


# The loops below work on one block at a time through slices, which start at index 0: numba then
# knows every index is non-negative (no wrap-around check) and LLVM vectorises the loops.


@_jit
def _signed(s):  # pragma: no cover - compiled
    """(+s, −s) as the reference forms them: 2s·1 − s and 2s·0 − s, in fp32."""
    s = np.float32(s)
    two_s = np.float32(2.0) * s
    return two_s - s, np.float32(0.0) - s


@_jit
def _flags(c, flags):  # pragma: no cover - compiled
    """flags[i] = 1 if c[i] ≥ 0 else 0 (both zeros count as ≥ 0)."""
    for i in range(c.size):
        flags[i] = np.uint8(1) if c[i] >= np.float32(0.0) else np.uint8(0)


@_jit
def _gather_bytes(flags64, bits):  # pragma: no cover - compiled
    """bits[k] = the 8 flag bytes of flags64[k] (each 0 or 1) as one byte, first flag in the MSB.

    Multiplying by 0x8040201008040201 moves flag j (bit 8j) to bit 63 − j; no two partial
    products share a bit, so nothing carries and the top byte is the packed result.
    """
    magic = np.uint64(0x8040201008040201)
    shift = np.uint64(56)
    for k in range(bits.size):
        bits[k] = np.uint8((flags64[k] * magic) >> shift)


@_jit
def _spread_bytes(bits, flags64):  # pragma: no cover - compiled
    """flags64[k] = the 8 bits of bits[k], MSB first, one per byte (zero or non-zero)."""
    repeat = np.uint64(0x0101010101010101)
    select = np.uint64(0x0102040810204080)  # byte j keeps bit 7 − j
    for k in range(bits.size):
        flags64[k] = (np.uint64(bits[k]) * repeat) & select


@_jit
def _error_update(c, plus, minus, e):  # pragma: no cover - compiled
    """e = c − (+s if c ≥ 0 else −s); ``e`` must not overlap ``c`` (see _error_update_inplace)."""
    for i in range(c.size):
        v = c[i]
        e[i] = v - (plus if v >= np.float32(0.0) else minus)


@_jit
def _error_update_inplace(c, plus, minus):  # pragma: no cover - compiled
    """c = c − (+s if c ≥ 0 else −s)."""
    for i in range(c.size):
        v = c[i]
        c[i] = v - (plus if v >= np.float32(0.0) else minus)


@_jit
def _pack_update(c, s, e, bits):  # pragma: no cover - compiled
    """bits = pack(c ≥ 0), MSB first; e ← c − s·sgn(c); ``e`` does not overlap ``c``."""
    plus, minus = _signed(s)
    flags = np.empty(_BLOCK, dtype=np.uint8)
    flags64 = flags.view(np.uint64)
    n_bytes = bits.size
    for b0 in range(0, n_bytes, _BLOCK // 8):
        b1 = min(n_bytes, b0 + _BLOCK // 8)
        cb = c[8 * b0 : 8 * b1]
        _flags(cb, flags[: cb.size])
        _gather_bytes(flags64[: b1 - b0], bits[b0:b1])
        _error_update(cb, plus, minus, e[8 * b0 : 8 * b1])


@_jit
def _pack_update_inplace(c, s, bits):  # pragma: no cover - compiled
    """bits = pack(c ≥ 0), MSB first; c ← c − s·sgn(c) (the server error holding c_s)."""
    plus, minus = _signed(s)
    flags = np.empty(_BLOCK, dtype=np.uint8)
    flags64 = flags.view(np.uint64)
    n_bytes = bits.size
    for b0 in range(0, n_bytes, _BLOCK // 8):
        b1 = min(n_bytes, b0 + _BLOCK // 8)
        cb = c[8 * b0 : 8 * b1]
        _flags(cb, flags[: cb.size])
        _gather_bytes(flags64[: b1 - b0], bits[b0:b1])
        _error_update_inplace(cb, plus, minus)


@_jit
def _accumulate_signed(flags, plus, minus, acc):  # pragma: no cover - compiled
    """acc[j] += (+s if flags[j] else −s)."""
    for j in range(acc.size):
        acc[j] += plus if flags[j] != 0 else minus


@_jit
def _average_compensate(acc, n, f):  # pragma: no cover - compiled
    """f[j] = acc[j]/n + f[j] (two fp32 roundings, as the reference)."""
    for j in range(acc.size):
        f[j] = acc[j] / n + f[j]


@_jit
def _server_average(recv, scales, f):  # pragma: no cover - compiled
    """f ← c_s = (Σ_i ±s_i in rank order)/n + f, block by block; returns Σ c_s² (fp64)."""
    n, chunk_bytes = recv.shape
    acc = np.empty(_BLOCK, dtype=np.float32)
    flags = np.empty(_BLOCK, dtype=np.uint8)
    flags64 = flags.view(np.uint64)
    n32 = np.float32(n)
    total = 0.0
    for b0 in range(0, chunk_bytes, _BLOCK // 8):
        b1 = min(chunk_bytes, b0 + _BLOCK // 8)
        m = 8 * (b1 - b0)
        a = acc[:m]
        a[:] = np.float32(0.0)
        for i in range(n):
            plus, minus = _signed(scales[i])
            _spread_bytes(recv[i, b0:b1], flags64)
            _accumulate_signed(flags[:m], plus, minus, a)
        fb = f[8 * b0 : 8 * b1]
        _average_compensate(a, n32, fb)
        total += _sum_squares(fb)
    return total


@_jit
def _select_signed(flags, plus, minus, out):  # pragma: no cover - compiled
    """out[j] = +s if flags[j] else −s."""
    for j in range(out.size):
        out[j] = plus if flags[j] != 0 else minus


@_jit
def _unpack(bits, scales, out):  # pragma: no cover - compiled
    """out[q] = t_j·sgn(bit q) for the first out.size elements of the [n, M/8] bit rows."""
    n, chunk_bytes = bits.shape
    flags = np.empty(_BLOCK, dtype=np.uint8)
    flags64 = flags.view(np.uint64)
    n_true = out.size
    chunk = 8 * chunk_bytes
    for row in range(n):
        lo = row * chunk
        if lo >= n_true:
            break
        plus, minus = _signed(scales[row])
        hi = min(n_true, lo + chunk)
        for b0 in range(0, chunk_bytes, _BLOCK // 8):
            q0 = lo + 8 * b0
            if q0 >= hi:
                break
            b1 = min(chunk_bytes, b0 + _BLOCK // 8)
            q1 = min(hi, lo + 8 * b1)
            _spread_bytes(bits[row, b0:b1], flags64)
            _select_signed(flags[: q1 - q0], plus, minus, out[q0:q1])


def _rms(sum_squares: float, numel: int) -> torch.Tensor:
    """√(Σ c²)/√numel from an fp64 sum of squares, rounded once to fp32.

    Overflow-free for every finite buffer (the fp64 sum cannot overflow for fp32 input), inf/NaN
    when the buffer holds inf/NaN, and within half an ulp (plus the fp64 summation error) of the
    exact value.
    """
    return torch.tensor([math.sqrt(sum_squares) / math.sqrt(numel)], dtype=torch.float32)


def _plain(*tensors: torch.Tensor) -> bool:
    """True when every tensor is a contiguous CPU tensor (the compiled loops' assumption)."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


class NumbaKernels:
    r"""Fused CPU path (SPEC §1 steps 1–4, 6–7, 9), bit-identical to :class:`TorchKernels`.

    Anything the compiled loops do not handle (non-contiguous or non-fp32 tensors, other
    devices) goes to the reference implementation instead, so every call is answered.
    """

    name = "numba"

    def __init__(self) -> None:
        self._reference = TorchKernels()

    def compensate(
        self, x: torch.Tensor, worker_error: torch.Tensor, c: torch.Tensor
    ) -> torch.Tensor:
        r"""Steps 1–2: c = pad(x) + e; return s = ‖c‖₂/√N (1-element fp32 tensor)."""
        if not (
            _plain(x, worker_error, c) and x.dtype == worker_error.dtype == c.dtype == torch.float32
        ):
            return self._reference.compensate(x, worker_error, c)
        sum_squares = _compensate(_np(x).reshape(-1), _np(worker_error), _np(c))
        return _rms(sum_squares, c.numel())

    def pack_worker_(
        self, c: torch.Tensor, s: torch.Tensor, worker_error: torch.Tensor, bits: torch.Tensor
    ) -> None:
        r"""Steps 3–4: bits = pack(c ≥ 0) MSB first; e ← c − s·sgn(c)."""
        if not (_plain(c, worker_error, bits) and c.dtype == worker_error.dtype == torch.float32):
            return self._reference.pack_worker_(c, s, worker_error, bits)
        _pack_update(_np(c), np.float32(s.item()), _np(worker_error), _np(bits))
        return None

    def server_reduce_(
        self,
        recv_bits: torch.Tensor,
        scales: torch.Tensor,
        server_error: torch.Tensor,
        bits: torch.Tensor,
    ) -> torch.Tensor:
        r"""Steps 6–7: a = (Σ_i s_i·sgn_i)/n in rank order; c_s = a + f; t = ‖c_s‖₂/√M;
        bits = pack(c_s ≥ 0); f ← c_s − t·sgn(c_s). Returns t."""
        if not (
            _plain(recv_bits, scales, server_error, bits)
            and scales.dtype == server_error.dtype == torch.float32
        ):
            return self._reference.server_reduce_(recv_bits, scales, server_error, bits)
        f = _np(server_error)
        sum_squares = _server_average(_np(recv_bits), _np(scales), f)
        t = _rms(sum_squares, f.size)
        _pack_update_inplace(f, t.numpy()[0], _np(bits))  # f holds c_s here
        return t

    def unpack_scaled_(self, bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        r"""Step 9: out = concat_j t_j·sgn(bits_j), first out.numel() elements."""
        if not (_plain(bits, scales, out) and scales.dtype == out.dtype == torch.float32):
            return self._reference.unpack_scaled_(bits, scales, out)
        _unpack(_np(bits), _np(scales), _np(out).reshape(-1))
        return None
