"""The per-element work of the compressed allreduce: one interface, chosen by device.

A kernel set implements four functions (SPEC §1; N padded length, M = N/n the server chunk):

- ``compensate(x, e, c) -> s``: c = pad(x) + e; s = ‖c‖₂/√N as a 1-element fp32 tensor.
- ``pack_worker_(c, s, e, bits)``: bits = pack(c ≥ 0), MSB first; e ← c − s·sgn(c).
- ``scale(x, e) -> s`` and ``pack_compensated_(x, s, e, bits)``: the same two steps without an
  N-element c: s from pad(x) + e computed on the fly, then c recomputed (the same fp32 add) while
  packing. :func:`commopt.compressed_allreduce` uses this pair; x must not change in between.
- ``server_reduce_(recv_bits[n, M/8], scales[n], f, bits) -> t``:
  a = (Σ_i s_i·sgn_i)/n summed in rank order; c_s = a + f; t = ‖c_s‖₂/√M;
  bits = pack(c_s ≥ 0); f ← c_s − t·sgn(c_s).
- ``unpack_scaled_(bits[n, M/8], scales[n], out)``: out = concat_j t_j·sgn(bits_j)[:L].
- ``guard_denominator_(out, m, d, bound, where)``: the optimizers' step guard
  (:mod:`commopt.optim.adam`) on the indices ``where``: out[where] = max(d, |m|/bound)[where].

Optionally, ``server_stages(f) -> ServerStages``: ``server_reduce_`` cut into stages over
ranges of the chunk (average each range as its bits arrive, then t over the whole chunk, then
pack each range), bit-identical to one ``server_reduce_`` call. The pipelined allreduce
(:mod:`commopt.pipelined`) needs it; a kernel set without it is run unpipelined.

Every elementwise result is one correctly rounded fp32 operation, so implementations agree bit
for bit; only the two norms may differ by reduction order.

Implementations (SPEC §6), picked by :func:`get_kernels`:

- :class:`TorchKernels` — the reference, any device; the fallback. Falling back on CPU or CUDA
  costs most of the speed-up the library exists for, so it is announced once per process with
  a :class:`SlowKernelsWarning` saying what it costs and how to fix it.
- ``NumbaKernels`` (:mod:`commopt.kernels.numba_kernels`) — fused CPU loops; numba is a
  dependency of commopt, so a plain ``pip install`` has them.
- ``CupyKernels`` (:mod:`commopt.kernels.cupy_kernels`) — the CUDA C kernels of the top-level
  ``cuda/`` folder compiled by CuPy, for CUDA tensors when CuPy is installed (the ``cuda`` extra).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator

import torch

from commopt.kernels.protocol import Kernels, ServerStages
from commopt.kernels.torch_kernels import TorchKernels

__all__ = [
    "Kernels",
    "ServerStages",
    "SlowKernelsWarning",
    "TorchKernels",
    "available_kernels",
    "get_kernels",
    "use_kernels",
]


class SlowKernelsWarning(RuntimeWarning):
    """The fast kernels for a device are unavailable; the torch reference runs instead."""


# What falling back costs, measured in docs/performance.md (16M fp32, 4 ranks, 1 Gbit/s).
_CPU_FALLBACK = (
    "commopt: numba cannot be imported ({err}), so compressed exchanges on CPU use the "
    "reference TorchKernels: about 6-8x more CPU time per element, which on a 1 Gbit/s link "
    "turns a 3-5x speed-up over a dense fp32 all_reduce into none (or a slow-down under load). "
    "Results are the same. Fix: pip install 'numba>=0.59' (a dependency of commopt; it was "
    "removed or failed to import), then check with "
    "python -c 'import commopt.kernels.numba_kernels'"
)
_CUDA_FALLBACK = (
    "commopt: CuPy cannot be imported ({err}), so compressed exchanges on CUDA use the "
    "reference TorchKernels: several extra passes over memory per call (results are the "
    "same). Fix: pip install 'commopt[cuda]' (CuPy for CUDA 12)"
)


_override: Kernels | None = None
_torch_kernels = TorchKernels()


@functools.cache
def _cpu_fast() -> Kernels | None:
    """NumbaKernels, or None when numba cannot be imported (warned once per process)."""
    try:
        from commopt.kernels.numba_kernels import NumbaKernels
    except ImportError as exc:
        warnings.warn(_CPU_FALLBACK.format(err=exc), SlowKernelsWarning, stacklevel=4)
        return None
    return NumbaKernels()


@functools.cache
def _cuda_fast() -> Kernels | None:
    """CupyKernels, or None when CuPy cannot be imported (warned once per process)."""
    try:
        from commopt.kernels.cupy_kernels import CupyKernels

        return CupyKernels()  # imports CuPy (its runtime is injectable, so not at module import)
    except ImportError as exc:
        warnings.warn(_CUDA_FALLBACK.format(err=exc), SlowKernelsWarning, stacklevel=4)
        return None


def get_kernels(device: torch.device | str) -> Kernels:
    """The kernel set for tensors on ``device``, unless :func:`use_kernels` overrides it.

    CUDA → CuPy kernels when CuPy is importable; CPU → the numba kernels when numba is
    importable; anything else, or either library missing → :class:`TorchKernels`.
    """
    if _override is not None:
        return _override
    kind = torch.device(device).type
    fast = _cuda_fast() if kind == "cuda" else _cpu_fast() if kind == "cpu" else None
    return fast if fast is not None else _torch_kernels


def available_kernels(device: torch.device | str) -> list[Kernels]:
    """Every kernel set usable on ``device``, the one :func:`get_kernels` prefers first."""
    kind = torch.device(device).type
    fast = _cuda_fast() if kind == "cuda" else _cpu_fast() if kind == "cpu" else None
    return [fast, _torch_kernels] if fast is not None else [_torch_kernels]


@contextlib.contextmanager
def use_kernels(kernels: Kernels) -> Iterator[None]:
    """Force one kernel set for every device inside the ``with`` block (tests, benchmarks)."""
    global _override
    previous, _override = _override, kernels
    try:
        yield
    finally:
        _override = previous
