"""The per-element work of the compressed allreduce in plain torch (numpy for bit packing on CPU).

This is the reference implementation and the fallback for every device: each function is a few
whole-tensor operations whose floating-point results are defined exactly (see
:mod:`commopt.kernels`), so a faster implementation can be checked against it bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["TorchKernels"]

# Bit weights of one packed byte, most significant first (numpy ``packbits`` order).
_MSB_FIRST = (128, 64, 32, 16, 8, 4, 2, 1)


def _pack_signs(pos: torch.Tensor, out: torch.Tensor) -> None:
    """out[k] = byte whose bit 7−i is pos[8k+i]."""
    if pos.device.type == "cpu":
        out.numpy()[:] = np.packbits(pos.numpy())
        return
    weights = torch.tensor(_MSB_FIRST, dtype=torch.uint8, device=pos.device)
    torch.sum(pos.view(-1, 8).to(torch.uint8) * weights, dim=1, dtype=torch.uint8, out=out)


def _unpack_signs(bits: torch.Tensor) -> torch.Tensor:
    """bool tensor of 8·len(bits) elements; True where the bit is set (MSB first)."""
    if bits.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(bits.numpy()).view(np.bool_))
    weights = torch.tensor(_MSB_FIRST, dtype=torch.uint8, device=bits.device)
    return (bits.view(-1, 1) & weights).ne(0).view(-1)


def _signed_scale(pos: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = s·sgn: +s where pos else −s, exactly (2s·b − s is exact in binary floating point)."""
    torch.mul(pos, 2 * s, out=out)
    return out.sub_(s)


def _rms(t: torch.Tensor) -> torch.Tensor:
    """‖t‖₂ / √numel as a 1-element fp32 tensor.

    The fp32 sum of squares overflows once elements reach ≈1e19 although the result is far
    below the fp32 range; then (only then) the norm is redone in float64, which keeps inf/NaN
    input non-finite and gives a finite scale for every finite buffer.
    """
    rms = torch.linalg.vector_norm(t) / math.sqrt(t.numel())
    if not bool(torch.isfinite(rms)):
        rms = (torch.linalg.vector_norm(t, dtype=torch.float64) / math.sqrt(t.numel())).float()
    return rms.reshape(1)


class TorchKernels:
    """Reference per-element path (SPEC §1 steps 1–4, 6–7, 9) for any device."""

    name = "torch"

    def compensate(
        self, x: torch.Tensor, worker_error: torch.Tensor, c: torch.Tensor
    ) -> torch.Tensor:
        """Step 1–2: c = pad(x) + e; return s = ‖c‖₂/√N (1-element fp32 tensor)."""
        n_true = x.numel()
        torch.add(x, worker_error[:n_true], out=c[:n_true])
        c[n_true:] = worker_error[n_true:]
        return _rms(c)

    def scale(self, x: torch.Tensor, worker_error: torch.Tensor) -> torch.Tensor:
        """Steps 1–2 when c is not kept: s = ‖pad(x) + e‖₂/√N (here c is a temporary)."""
        return self.compensate(x, worker_error, torch.empty_like(worker_error))

    def pack_compensated_(
        self, x: torch.Tensor, s: torch.Tensor, worker_error: torch.Tensor, bits: torch.Tensor
    ) -> None:
        """Steps 1, 3–4: c = pad(x) + e recomputed, then :meth:`pack_worker_` on it."""
        c = torch.empty_like(worker_error)
        n_true = x.numel()
        torch.add(x, worker_error[:n_true], out=c[:n_true])
        c[n_true:] = worker_error[n_true:]
        self.pack_worker_(c, s, worker_error, bits)

    def pack_worker_(
        self, c: torch.Tensor, s: torch.Tensor, worker_error: torch.Tensor, bits: torch.Tensor
    ) -> None:
        """Steps 3–4: bits = pack(c ≥ 0); e ← c − s·sgn(c)."""
        pos = c.ge(0)
        _pack_signs(pos, bits)
        torch.sub(c, _signed_scale(pos, s, worker_error), out=worker_error)

    def server_reduce_(
        self,
        recv_bits: torch.Tensor,
        scales: torch.Tensor,
        server_error: torch.Tensor,
        bits: torch.Tensor,
    ) -> torch.Tensor:
        """Steps 6–7: a = (Σ_i s_i·sgn_i)/n summed in rank order; c_s = a + f;
        t = ‖c_s‖₂/√M; bits = pack(c_s ≥ 0); f ← c_s − t·sgn(c_s). Returns t."""
        n = recv_bits.shape[0]
        acc = torch.zeros_like(server_error)
        term = torch.empty_like(server_error)
        for i in range(n):
            acc.add_(_signed_scale(_unpack_signs(recv_bits[i]), scales[i], term))
        c_s = acc.div_(n).add_(server_error)
        t = _rms(c_s)
        pos = c_s.ge(0)
        _pack_signs(pos, bits)
        torch.sub(c_s, _signed_scale(pos, t, term), out=server_error)
        return t

    def server_stages(self, server_error: torch.Tensor) -> _TorchServerStages:
        """:meth:`server_reduce_` in pieces (see :class:`commopt.kernels.ServerStages`)."""
        return _TorchServerStages(server_error)

    def guard_denominator_(
        self,
        out: torch.Tensor,
        m: torch.Tensor,
        d: torch.Tensor,
        bound: float,
        where: torch.Tensor,
    ) -> None:
        """The step guard's denominator
        (:func:`commopt.optim.adam.guarded_denominator`) on the elements ``where`` (1-D
        int64 indices): out[where] = max(d, |m|/bound) there; nothing else is written."""
        floor = m[where].abs().div_(bound)
        out[where] = torch.maximum(d[where], floor)

    def unpack_scaled_(self, bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        """Step 9: out = concat_j t_j·sgn(bits_j), first out.numel() elements."""
        n, chunk_bytes = bits.shape
        chunk = 8 * chunk_bytes
        n_true = out.numel()
        for j in range(n):
            lo = j * chunk
            if lo >= n_true:
                break
            hi = min(n_true, lo + chunk)
            pos = _unpack_signs(bits[j])[: hi - lo]
            _signed_scale(pos, scales[j], out[lo:hi])


class _TorchServerStages:
    """:meth:`TorchKernels.server_reduce_` in stages, with the same operations per element and
    the same norm (one ``_rms`` over the whole chunk once it holds c_s)."""

    align = 8

    def __init__(self, server_error: torch.Tensor) -> None:
        self.f = server_error

    def average_(self, recv_bits: torch.Tensor, scales: torch.Tensor, lo: int) -> None:
        n = recv_bits.shape[0]
        f = self.f[lo : lo + 8 * recv_bits.shape[1]]
        acc = torch.zeros_like(f)
        term = torch.empty_like(f)
        for i in range(n):
            acc.add_(_signed_scale(_unpack_signs(recv_bits[i]), scales[i], term))
        torch.add(acc.div_(n), f, out=f)

    def scale(self) -> torch.Tensor:
        return _rms(self.f)

    def pack_(self, t: torch.Tensor, lo: int, bits: torch.Tensor) -> None:
        c_s = self.f[lo : lo + 8 * bits.numel()]
        pos = c_s.ge(0)
        _pack_signs(pos, bits)
        c_s.sub_(_signed_scale(pos, t, torch.empty_like(c_s)))
