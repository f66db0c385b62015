r"""The CPU kernels: :class:`NumbaKernels`, the :class:`~commopt.kernels.Kernels` interface over
the compiled loops of :mod:`commopt.kernels.numba_loops`.

Each method checks that its tensors are what the loops assume (contiguous fp32 on the CPU), hands
their memory to one loop as numpy arrays and turns the loop's fp64 sum of squares into a scale;
anything else goes to :class:`~commopt.kernels.TorchKernels`, so every call is answered and the
results are the reference's bit for bit (see :mod:`commopt.kernels.numba_loops` for why).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

import commopt.kernels.numba_loops as loops
from commopt.kernels.torch_kernels import TorchKernels

if TYPE_CHECKING:
    from commopt.kernels.protocol import ServerStages

__all__ = ["NumbaKernels"]


class _NumbaServerStages:
    """Steps 6–7 of one server chunk f in stages; equal to one ``server_reduce_`` bit for bit.

    ``average_`` keeps each 4096-element block's Σ c_s² (the same compiled loop as
    ``server_reduce_``), so ``scale`` adds the same numbers in the same order.
    """

    align = loops.BLOCK

    def __init__(self, server_error: torch.Tensor, reference: TorchKernels) -> None:
        self.f = server_error
        self._block_sums = np.full(
            -(-server_error.numel() // loops.BLOCK), np.nan, dtype=np.float64
        )
        self._fallback = None
        if not (_plain(server_error) and server_error.dtype == torch.float32):
            self._fallback = reference.server_stages(server_error)

    def average_(self, recv_bits: torch.Tensor, scales: torch.Tensor, lo: int) -> None:
        """f[lo : lo + 8·recv_bits.shape[1]] ← c_s from the workers' signs for that range."""
        if self._fallback is not None:
            return self._fallback.average_(recv_bits, scales, lo)
        if lo % loops.BLOCK:
            raise ValueError(f"server stage starts at {lo}, not a multiple of {loops.BLOCK}")
        hi = lo + 8 * recv_bits.shape[1]
        loops.server_average(
            _np(recv_bits), _np(scales), _np(self.f)[lo:hi], self._block_sums[lo // loops.BLOCK :]
        )
        return None

    def scale(self) -> torch.Tensor:
        """t = ‖c_s‖₂/√M once every element of f has been averaged."""
        if self._fallback is not None:
            return self._fallback.scale()
        return _rms(loops.ordered_sum(self._block_sums), self.f.numel())

    def pack_(self, t: torch.Tensor, lo: int, bits: torch.Tensor) -> None:
        """bits = pack(c_s ≥ 0) and f ← c_s − t·sgn(c_s) on f[lo : lo + 8·bits.numel()]."""
        if self._fallback is not None:
            return self._fallback.pack_(t, lo, bits)
        f = _np(self.f)[lo : lo + 8 * bits.numel()]
        loops.pack_update(f, t.numpy()[0], f, _np(bits), True)
        return None


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
        sum_squares = loops.compensate(_np(x).reshape(-1), _np(worker_error), _np(c))
        return _rms(sum_squares, c.numel())

    def warm_up(self) -> None:
        r"""Compile (or load from numba's disk cache) every loop :func:`compressed_allreduce` and
        the optimizers' step guard use.

        The first call of each kernel otherwise compiles it: about 5 s of CPU per process with an
        empty cache (so ≈ 10 s for 4 ranks started together on 2 cores), about 0.6 s once the
        cache is filled. Call this once per machine (e.g. after installing) to fill the cache.
        """
        f32 = {"dtype": torch.float32}  # whatever torch's default dtype is
        x, e, f = torch.ones(13, **f32), torch.zeros(16, **f32), torch.zeros(8, **f32)
        bits, server_bits = torch.empty(2, dtype=torch.uint8), torch.empty(1, dtype=torch.uint8)
        s = self.scale(x, e)
        self.pack_compensated_(x, s, e, bits)
        self.pack_worker_(torch.ones(16, **f32), s, e, bits)
        self.compensate(x, e, torch.empty(16, **f32))
        t = self.server_reduce_(bits.view(2, 1), torch.ones(2, **f32), f, server_bits)
        self.unpack_scaled_(bits.view(2, 1), t.repeat(2), torch.empty(13, **f32))
        self.guard_denominator_(
            torch.empty(13, **f32), x, x, 1.0, torch.arange(2)
        )  # the step guard

    def scale(self, x: torch.Tensor, worker_error: torch.Tensor) -> torch.Tensor:
        r"""Steps 1–2 without storing c: s = ‖pad(x) + e‖₂/√N (1-element fp32 tensor)."""
        if not (_plain(x, worker_error) and x.dtype == worker_error.dtype == torch.float32):
            return self._reference.scale(x, worker_error)
        return _rms(loops.scale_sum(_np(x).reshape(-1), _np(worker_error)), worker_error.numel())

    def pack_compensated_(
        self, x: torch.Tensor, s: torch.Tensor, worker_error: torch.Tensor, bits: torch.Tensor
    ) -> None:
        r"""Steps 1, 3–4 in one pass: c = pad(x) + e; bits = pack(c ≥ 0); e ← c − s·sgn(c)."""
        if not (_plain(x, worker_error, bits) and x.dtype == worker_error.dtype == torch.float32):
            return self._reference.pack_compensated_(x, s, worker_error, bits)
        loops.pack_compensated(
            _np(x).reshape(-1), np.float32(s.item()), _np(worker_error), _np(bits)
        )
        return None

    def pack_worker_(
        self, c: torch.Tensor, s: torch.Tensor, worker_error: torch.Tensor, bits: torch.Tensor
    ) -> None:
        r"""Steps 3–4: bits = pack(c ≥ 0) MSB first; e ← c − s·sgn(c)."""
        if not (_plain(c, worker_error, bits) and c.dtype == worker_error.dtype == torch.float32):
            return self._reference.pack_worker_(c, s, worker_error, bits)
        loops.pack_update(_np(c), np.float32(s.item()), _np(worker_error), _np(bits), False)
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
        block_sums = np.empty(-(-f.size // loops.BLOCK), dtype=np.float64)
        loops.server_average(_np(recv_bits), _np(scales), f, block_sums)
        t = _rms(loops.ordered_sum(block_sums), f.size)
        loops.pack_update(f, t.numpy()[0], f, _np(bits), True)  # f holds c_s: in place
        return t

    def server_stages(self, server_error: torch.Tensor) -> ServerStages:
        """:meth:`server_reduce_` in pieces, for the pipelined allreduce (see
        :class:`commopt.kernels.ServerStages`); stage boundaries must be multiples of 4096."""
        return _NumbaServerStages(server_error, self._reference)

    def guard_denominator_(
        self,
        out: torch.Tensor,
        m: torch.Tensor,
        d: torch.Tensor,
        bound: float,
        where: torch.Tensor,
    ) -> None:
        r"""out[where] = max(d, |m|/bound)[where], one gather and one scatter per index (the
        reference's when m or d holds a NaN there; ``out`` must not overlap ``m``)."""
        if not (
            _plain(out, m, d, where)
            and out.dtype == m.dtype == d.dtype == torch.float32
            and where.dtype == torch.int64
            and where.dim() == 1
        ):
            return self._reference.guard_denominator_(out, m, d, bound, where)
        if not loops.guard_denominator(
            _np(out).reshape(-1), _np(m).reshape(-1), _np(d).reshape(-1), bound, _np(where)
        ):
            self._reference.guard_denominator_(out, m, d, bound, where)
        return None

    def unpack_scaled_(self, bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        r"""Step 9: out = concat_j t_j·sgn(bits_j), first out.numel() elements."""
        if not (_plain(bits, scales, out) and scales.dtype == out.dtype == torch.float32):
            return self._reference.unpack_scaled_(bits, scales, out)
        loops.unpack(_np(bits), _np(scales), _np(out).reshape(-1))
        return None
