"""The per-element work of the compressed allreduce: one interface, chosen by device.

A kernel set implements four functions (SPEC §1; N padded length, M = N/n the server chunk):

- ``compensate(x, e, c) -> s``: c = pad(x) + e; s = ‖c‖₂/√N as a 1-element fp32 tensor.
- ``pack_worker_(c, s, e, bits)``: bits = pack(c ≥ 0), MSB first; e ← c − s·sgn(c).
- ``server_reduce_(recv_bits[n, M/8], scales[n], f, bits) -> t``:
  a = (Σ_i s_i·sgn_i)/n summed in rank order; c_s = a + f; t = ‖c_s‖₂/√M;
  bits = pack(c_s ≥ 0); f ← c_s − t·sgn(c_s).
- ``unpack_scaled_(bits[n, M/8], scales[n], out)``: out = concat_j t_j·sgn(bits_j)[:L].

Every elementwise result is one correctly rounded fp32 operation, so implementations agree bit
for bit; only the two norms may differ by reduction order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch

from commopt.kernels.torch_kernels import TorchKernels

__all__ = ["Kernels", "TorchKernels", "get_kernels", "use_kernels"]


class Kernels(Protocol):
    name: str

    def compensate(self, x: torch.Tensor, worker_error: torch.Tensor, c: torch.Tensor) -> torch.Tensor: ...

    def pack_worker_(
        self, c: torch.Tensor, s: torch.Tensor, worker_error: torch.Tensor, bits: torch.Tensor
    ) -> None: ...

    def server_reduce_(
        self, recv_bits: torch.Tensor, scales: torch.Tensor, server_error: torch.Tensor, bits: torch.Tensor
    ) -> torch.Tensor: ...

    def unpack_scaled_(self, bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None: ...


_override: Kernels | None = None
_torch_kernels = TorchKernels()


def get_kernels(device: torch.device) -> Kernels:
    """The kernel set for tensors on ``device``, unless :func:`use_kernels` overrides it."""
    if _override is not None:
        return _override
    return _torch_kernels


@contextlib.contextmanager
def use_kernels(kernels: Kernels) -> Iterator[None]:
    """Force one kernel set for every device inside the ``with`` block (tests, benchmarks)."""
    global _override
    previous, _override = _override, kernels
    try:
        yield
    finally:
        _override = previous
