"""What a kernel set provides (:class:`Kernels`), and the server step cut into stages
(:class:`ServerStages`); the contract is in :mod:`commopt.kernels`."""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["Kernels", "ServerStages"]


class Kernels(Protocol):
    """One device's kernel set for the compressed allreduce (:mod:`commopt.kernels`, SPEC §1)."""

    name: str

    def compensate(
        self, x: torch.Tensor, worker_error: torch.Tensor, c: torch.Tensor
    ) -> torch.Tensor:
        """c = pad(x) + e; returns s = ‖c‖₂/√N (a 1-element fp32 tensor)."""

    def pack_worker_(
        self, c: torch.Tensor, s: torch.Tensor, worker_error: torch.Tensor, bits: torch.Tensor
    ) -> None:
        """bits = pack(c ≥ 0), MSB first; e ← c − s·sgn(c)."""

    def scale(self, x: torch.Tensor, worker_error: torch.Tensor) -> torch.Tensor:
        """s of pad(x) + e without writing c."""

    def pack_compensated_(
        self, x: torch.Tensor, s: torch.Tensor, worker_error: torch.Tensor, bits: torch.Tensor
    ) -> None:
        """pack_worker_ of c = pad(x) + e recomputed on the fly (x unchanged since ``scale``)."""

    def server_reduce_(
        self,
        recv_bits: torch.Tensor,
        scales: torch.Tensor,
        server_error: torch.Tensor,
        bits: torch.Tensor,
    ) -> torch.Tensor:
        """a = (Σ_i s_i·sgn_i)/n in rank order; c = a + f; t = ‖c‖₂/√M; bits = pack(c ≥ 0); f ← c −
        t·sgn(c); returns t."""

    def unpack_scaled_(self, bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        """out = concat_j t_j·sgn(bits_j), cut to out's length."""

    def guard_denominator_(
        self,
        out: torch.Tensor,
        m: torch.Tensor,
        d: torch.Tensor,
        bound: float,
        where: torch.Tensor,
    ) -> None:
        """out[where] = max(d, |m|/bound)[where] (the optimizers' step guard)."""


class ServerStages(Protocol):
    """One server chunk f (M elements) reduced in stages; see :class:`Kernels`.

    Call ``average_`` once for every range of f (any order, each range starting at a multiple
    of ``align``), then ``scale()``, then ``pack_`` over ranges; the result (f, bits, t) equals
    ``server_reduce_`` on the whole chunk bit for bit.
    """

    align: int

    def average_(self, recv_bits: torch.Tensor, scales: torch.Tensor, lo: int) -> None:
        """Add the range of f starting at ``lo`` from every rank's bits."""

    def scale(self) -> torch.Tensor:
        """t = ‖c‖₂/√M over the whole chunk, once every range is averaged."""

    def pack_(self, t: torch.Tensor, lo: int, bits: torch.Tensor) -> None:
        """Pack the range starting at ``lo`` and update f there."""
