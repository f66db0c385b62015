"""The server step of the CUDA kernels in stages (:meth:`CupyKernels.server_stages`), for the
pipelined allreduce (:mod:`commopt.pipelined`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from commopt.kernels import ServerStages
    from commopt.kernels.cupy_kernels import CupyKernels

__all__ = ["CupyServerStages", "server_blocks"]

# Elements per partial sum of the server kernel (COMMOPT_SERVER_BLOCK in cuda/server.cu): the
# partials of a server chunk are the same whether it is averaged in one launch or range by range
# (ranges starting at multiples of this), so t is too. Divides commopt.pipelined.ALIGN.
_SERVER_BLOCK = 1024


def server_blocks(length: int) -> int:
    """How many element blocks (partial sums) the server kernel has for ``length`` elements."""
    return -(-length // _SERVER_BLOCK)


class CupyServerStages:
    r"""Steps 6–7 of one server chunk f in stages; equal to one ``server_reduce_`` bit for bit.

    ``average_`` runs ``commopt_server_average`` on one range, which writes the fp64 Σ c_s² of
    each 1024-element block of the range into this chunk's partial sums; ``scale`` reduces all
    of them with ``commopt_finish_rms``, as ``server_reduce_`` does after averaging the whole
    chunk in one launch. Each block's sum is taken in one fixed order whatever the launch, so
    the partials, and t, are the same bits however the chunk was cut. ``pack_`` is the worker's
    pack-and-update kernel in place on one range of f.

    A chunk the CUDA kernels do not take (not a contiguous fp32 tensor of the runtime's device)
    goes to the reference's stages, as :meth:`CupyKernels.server_reduce_` goes to the reference.

    Raises:
        ValueError: a range that does not start at a multiple of :attr:`align`, ends neither at
            a multiple of it nor at the end of f, overlaps one averaged before or lies outside
            f; or ``scale()`` before every element of f was averaged.
    """

    align = _SERVER_BLOCK

    def __init__(self, kernels: CupyKernels, server_error: torch.Tensor) -> None:
        self.f = server_error
        self._kernels = kernels
        self._fallback: ServerStages | None = None
        if not (kernels._plain(server_error) and server_error.dtype == torch.float32):
            self._fallback = kernels._reference.server_stages(server_error)
            return
        m = server_error.numel()
        # NaN until averaged: a block left out would make t NaN rather than plausible.
        self._partial = torch.empty(
            max(1, server_blocks(m)), dtype=torch.float64, device=self.f.device
        )
        self._partial.fill_(float("nan"))
        self._averaged: dict[int, int] = {}  # lo -> hi of every range averaged so far

    def _range(self, lo: int, length: int, what: str) -> int:
        m = self.f.numel()
        hi = lo + length
        if lo % self.align or lo < 0 or hi > m or (hi % self.align and hi != m):
            raise ValueError(
                f"server {what} range [{lo}, {hi}) of a {m}-element chunk: it must start at a "
                f"multiple of {self.align} and end at one or at the end of the chunk"
            )
        return hi

    def average_(self, recv_bits: torch.Tensor, scales: torch.Tensor, lo: int) -> None:
        """f[lo : lo + 8·recv_bits.shape[1]] ← c_s from the workers' signs for that range."""
        if self._fallback is not None:
            return self._fallback.average_(recv_bits, scales, lo)
        hi = self._range(lo, 8 * recv_bits.shape[1], "stage")
        if any(lo < b and a < hi for a, b in self._averaged.items()):
            raise ValueError(f"server stage range [{lo}, {hi}) was averaged already")
        self._averaged[lo] = hi
        device = self.f.device
        recv_bits = recv_bits.to(device=device).contiguous()
        scales = scales.to(device=device, dtype=torch.float32).contiguous()
        kernels = self._kernels
        with kernels._runtime.launch(self.f) as launch:
            kernels._server_average(launch, recv_bits, scales, lo, self.f, self._partial)
        return None

    def scale(self) -> torch.Tensor:
        """t = ‖c_s‖₂/√M (1-element fp32, on the device) once every element has been averaged."""
        if self._fallback is not None:
            return self._fallback.scale()
        m = self.f.numel()
        done = sum(hi - lo for lo, hi in self._averaged.items())
        if done != m:
            raise ValueError(f"server scale() after averaging {done} of the chunk's {m} elements")
        t = torch.empty(1, dtype=torch.float32, device=self.f.device)
        with self._kernels._runtime.launch(self.f) as launch:
            self._kernels._rms(launch, self._partial, server_blocks(m), m, t)
        return t

    def pack_(self, t: torch.Tensor, lo: int, bits: torch.Tensor) -> None:
        """bits = pack(c_s ≥ 0) and f ← c_s − t·sgn(c_s) on f[lo : lo + 8·bits.numel()]."""
        if self._fallback is not None:
            return self._fallback.pack_(t, lo, bits)
        hi = self._range(lo, 8 * bits.numel(), "pack")
        t = t.to(device=self.f.device, dtype=torch.float32).reshape(1)
        out = bits if self._kernels._plain(bits) else torch.empty_like(bits, device=self.f.device)
        c_s = self.f[lo:hi]
        with self._kernels._runtime.launch(self.f) as launch:
            self._kernels._pack(launch, c_s, t, c_s, out)
        if out is not bits:
            bits.copy_(out)
        return None
