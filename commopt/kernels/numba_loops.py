r"""The per-element work of the compressed allreduce on CPU, fused and JIT-compiled with numba: the
loops behind :class:`~commopt.kernels.numba_kernels.NumbaKernels`, on numpy arrays, every one
compiled with ``nogil=True`` (a communication thread keeps running while they do).

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

import numba
import numpy as np

__all__ = [
    "BLOCK",
    "compensate",
    "guard_denominator",
    "ordered_sum",
    "pack_compensated",
    "pack_update",
    "scale_sum",
    "server_average",
    "sum_squares",
    "unpack",
]

# Elements per block of the fused loops: 16 KB of fp32, so a block written by one loop is still
# in L1 when the next loop over the same block reads it.
BLOCK = 4096

_jit = numba.njit(cache=True, nogil=True, error_model="numpy")
_jit_sum = numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"})


@_jit_sum
def compensate(x, e, c):  # pragma: no cover - compiled
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
def sum_squares(a):  # pragma: no cover - compiled
    """Σ a² in fp64, summed in any order."""
    acc = 0.0
    for i in range(a.size):
        d = np.float64(a[i])
        acc += d * d
    return acc


@_jit_sum
def scale_sum(x, e):  # pragma: no cover - compiled
    """Σ (pad(x) + e)² (fp64, summed in any order), without storing pad(x) + e."""
    n_true = x.size
    acc = 0.0
    for i in range(n_true):
        d = np.float64(x[i] + e[i])
        acc += d * d
    pad_e = e[n_true:]
    for i in range(pad_e.size):
        d = np.float64(pad_e[i])
        acc += d * d
    return acc


# The loops below run over one block at a time through slices, which start at index 0: numba
# then knows every index is non-negative (no wrap-around check) and LLVM vectorises each loop.
# Bit tricks, on one uint64 holding 8 flag bytes (little-endian: byte j ↔ element 8k + j):
# - pack: flags 0/1 times 0x8040201008040201 puts flag j (bit 8j) at bit 63 − j and no two
#   partial products share a bit (8j − 9i is distinct for every pair), so nothing carries and
#   the top byte is the packed byte, element 8k in its most significant bit;
# - spread: byte·0x0101010101010101 copies the byte into all 8 lanes; & 0x0102040810204080
#   keeps bit 7 − j in lane j, so lane j is non-zero exactly when element 8k + j is set.
_PACK = np.uint64(0x8040201008040201)
_REPEAT = np.uint64(0x0101010101010101)
_SPREAD = np.uint64(0x0102040810204080)


@_jit
def _pack_signs(cb, flags, flags64, bb):  # pragma: no cover - compiled
    """bb = pack(cb ≥ 0), MSB first (±0 count as ≥ 0): 8 flags per byte through a uint64
    multiply; ``flags`` is the caller's L1 scratch, ``flags64`` its uint64 view."""
    zero = np.float32(0.0)
    fb = flags[: cb.size]
    for i in range(cb.size):
        fb[i] = np.uint8(1) if cb[i] >= zero else np.uint8(0)
    f64 = flags64[: bb.size]
    for k in range(bb.size):
        bb[k] = np.uint8((f64[k] * _PACK) >> np.uint64(56))


@_jit
def _compensate(cb, plus, minus, out):  # pragma: no cover - compiled
    """out = cb − (+s if cb ≥ 0 else −s), with ±s as formed by the caller (may be cb itself)."""
    zero = np.float32(0.0)
    for i in range(cb.size):
        v = cb[i]
        out[i] = v - (plus if v >= zero else minus)


@_jit
def pack_update(c, s, e, bits, in_place):  # pragma: no cover - compiled
    """bits = pack(c ≥ 0), MSB first; e ← c − (2s·[c ≥ 0] − s).

    ``in_place`` means ``e`` is ``c`` (the server's f holding c_s); otherwise they must not
    overlap. ±s is formed as the reference forms it: 2s·1 − s and 2s·0 − s.
    """
    s = np.float32(s)
    two_s = np.float32(2.0) * s
    plus = two_s - s
    minus = np.float32(0.0) - s
    flags = np.empty(BLOCK, dtype=np.uint8)
    flags64 = flags.view(np.uint64)
    n_bytes = bits.size
    for b0 in range(0, n_bytes, BLOCK // 8):
        b1 = min(n_bytes, b0 + BLOCK // 8)
        cb = c[8 * b0 : 8 * b1]
        _pack_signs(cb, flags, flags64, bits[b0:b1])
        _compensate(cb, plus, minus, cb if in_place else e[8 * b0 : 8 * b1])


@_jit
def pack_compensated(x, s, e, bits):  # pragma: no cover - compiled
    """c = pad(x) + e, block by block into an L1 scratch; bits = pack(c ≥ 0); e ← c − s·sgn(c).

    The same operations as :func:`compensate` followed by :func:`pack_update`, without the
    N-element c: x and e are read once, e and the bits written once.
    """
    s = np.float32(s)
    two_s = np.float32(2.0) * s
    plus = two_s - s
    minus = np.float32(0.0) - s
    c = np.empty(BLOCK, dtype=np.float32)
    flags = np.empty(BLOCK, dtype=np.uint8)
    flags64 = flags.view(np.uint64)
    n_true = x.size
    n_bytes = bits.size
    for b0 in range(0, n_bytes, BLOCK // 8):
        b1 = min(n_bytes, b0 + BLOCK // 8)
        lo = 8 * b0
        eb = e[lo : 8 * b1]
        cb = c[: eb.size]
        n_x = min(max(n_true - lo, 0), eb.size)  # elements of this block that have an x
        if n_x == eb.size:
            xb = x[lo : lo + n_x]
            for i in range(n_x):
                cb[i] = xb[i] + eb[i]
        else:
            for i in range(n_x):
                cb[i] = x[lo + i] + eb[i]
            for i in range(n_x, eb.size):
                cb[i] = eb[i]
        _pack_signs(cb, flags, flags64, bits[b0:b1])
        _compensate(cb, plus, minus, eb)


@_jit
def server_average(recv, scales, f, block_sums):  # pragma: no cover - compiled
    """f ← c_s = (Σ_i ±s_i in rank order)/n + f, block by block; block_sums[b] = Σ c_s² over
    block b (fp64).

    Per block: for each worker row i, spread its bytes to flags and add ±s_i into an
    L1-resident accumulator (rank order, one fp32 add each); then one fp32 division by n and
    one fp32 add of f. The n·(N/n) unpacked values never exist. The per-block sums are added
    up by :func:`ordered_sum`, so a chunk averaged in several calls (the pipelined allreduce,
    at block boundaries) gets the same total as in one call.
    """
    n, chunk_bytes = recv.shape
    acc = np.empty(BLOCK, dtype=np.float32)
    flags = np.empty(BLOCK, dtype=np.uint8)
    flags64 = flags.view(np.uint64)
    n32 = np.float32(n)
    for b0 in range(0, chunk_bytes, BLOCK // 8):
        b1 = min(chunk_bytes, b0 + BLOCK // 8)
        m = 8 * (b1 - b0)
        a = acc[:m]
        a[:] = np.float32(0.0)
        fl = flags[:m]
        for i in range(n):
            s = scales[i]
            two_s = np.float32(2.0) * s
            plus = two_s - s
            minus = np.float32(0.0) - s
            row = recv[i, b0:b1]
            for k in range(row.size):
                flags64[k] = (np.uint64(row[k]) * _REPEAT) & _SPREAD
            for j in range(m):
                a[j] += plus if fl[j] != 0 else minus
        fb = f[8 * b0 : 8 * b1]
        for j in range(m):
            fb[j] = a[j] / n32 + fb[j]
        block_sums[b0 // (BLOCK // 8)] = sum_squares(fb)


@_jit
def ordered_sum(a):  # pragma: no cover - compiled
    """(((0 + a₀) + a₁) + …) in fp64, strictly in order (no reassociation allowed here)."""
    total = 0.0
    for i in range(a.size):
        total += a[i]
    return total


@_jit
def unpack(bits, scales, out):  # pragma: no cover - compiled
    """out[q] = 2t_j·bit(q) − t_j for the first out.size elements of the [n, M/8] bit rows."""
    n, chunk_bytes = bits.shape
    flags = np.empty(BLOCK, dtype=np.uint8)
    flags64 = flags.view(np.uint64)
    n_true = out.size
    chunk = 8 * chunk_bytes
    for row in range(n):
        lo = row * chunk
        if lo >= n_true:
            break
        t = scales[row]
        two_t = np.float32(2.0) * t
        plus = two_t - t
        minus = np.float32(0.0) - t
        hi = min(n_true, lo + chunk)
        for b0 in range(0, chunk_bytes, BLOCK // 8):
            q0 = lo + 8 * b0
            if q0 >= hi:
                break
            b1 = min(chunk_bytes, b0 + BLOCK // 8)
            rb = bits[row, b0:b1]
            for k in range(rb.size):
                flags64[k] = (np.uint64(rb[k]) * _REPEAT) & _SPREAD
            ob = out[q0 : min(hi, lo + 8 * b1)]
            fl = flags[: ob.size]
            for j in range(ob.size):
                ob[j] = plus if fl[j] != 0 else minus


@_jit
def guard_denominator(out, m, d, bound, where):  # pragma: no cover - compiled
    """out[i] = max(d[i], |m[i]|/bound) for i in ``where`` (indices into the three arrays);
    nothing else is written. Returns False, having stopped, at the first NaN in m or d.

    The reference's fp32 operations (``|m|`` then one division by fp32(bound)) and its maximum
    for non-NaN operands. Where torch's maximum meets a NaN, the NaN it returns depends on its
    vector width (all-ones bits in vector lanes, the operand in the scalar tail), so that case
    is left to the reference: the caller recomputes every index there (the values written before
    the stop are max(d, |m|/bound) already, so recomputing them changes nothing).
    """
    b = np.float32(bound)
    for k in range(where.size):
        i = where[k]
        x = d[i]
        f = abs(m[i]) / b
        if np.isnan(x) or np.isnan(f):
            return False
        out[i] = x if x >= f else f
    return True
