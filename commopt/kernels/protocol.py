"""What a kernel set provides (:class:`Kernels`), and the server step cut into stages
(:class:`ServerStages`); the contract is in :mod:`commopt.kernels`."""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["Kernels", "ServerStages"]


class Kernels(Protocol):
    name: str

    def compensate(
        self, x: torch.Tensor, worker_error: torch.Tensor, c: torch.Tensor
    ) -> torch.Tensor: ...

    def pack_worker_(
        self, c: torch.Tensor, s: torch.Tensor, worker_error: torch.Tensor, bits: torch.Tensor
    ) -> None: ...

    def scale(self, x: torch.Tensor, worker_error: torch.Tensor) -> torch.Tensor: ...

    def pack_compensated_(
        self, x: torch.Tensor, s: torch.Tensor, worker_error: torch.Tensor, bits: torch.Tensor
    ) -> None: ...

    def server_reduce_(
        self,
        recv_bits: torch.Tensor,
        scales: torch.Tensor,
        server_error: torch.Tensor,
        bits: torch.Tensor,
    ) -> torch.Tensor: ...

    def unpack_scaled_(
        self, bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor
    ) -> None: ...

    def guard_denominator_(
        self,
        out: torch.Tensor,
        m: torch.Tensor,
        d: torch.Tensor,
        bound: float,
        where: torch.Tensor,
    ) -> None: ...


class ServerStages(Protocol):
    """One server chunk f (M elements) reduced in stages; see :class:`Kernels`.

    Call ``average_`` once for every range of f (any order, each range starting at a multiple
    of ``align``), then ``scale()``, then ``pack_`` over ranges; the result (f, bits, t) equals
    ``server_reduce_`` on the whole chunk bit for bit.
    """

    align: int

    def average_(self, recv_bits: torch.Tensor, scales: torch.Tensor, lo: int) -> None: ...

    def scale(self) -> torch.Tensor: ...

    def pack_(self, t: torch.Tensor, lo: int, bits: torch.Tensor) -> None: ...
