r"""The per-element work of the compressed allreduce on CUDA: CuPy-compiled kernels from ``cuda/``.

The CUDA C sources live in the repository's top-level ``cuda/`` folder (``worker.cu``,
``server.cu``, ``unpack.cu``) and ship inside the wheel as ``commopt/cuda/*.cu``; CuPy's
``RawModule`` compiles them with NVRTC on first use (and caches the binary on disk). Each
:class:`CupyKernels` call is a handful of kernel launches:

- ``compensate``: one launch: a fused pass c = pad(x) + e with per-block fp64 partial sums of
  c², and the block that finishes last reduces the partials in a fixed order to
  s = √(Σc²)/√N. ``scale`` is the same without storing c, and ``pack_compensated_`` recomputes
  c while it packs (the pair :func:`commopt.compressed_allreduce` uses: no N-element
  temporary).
- ``pack_worker_``: one pass; each thread packs 4 signs into a nibble and pairs of lanes make a
  byte, MSB first, while it writes e ← c − s·sgn(c). s is read on the device: no host round
  trip.
- ``server_reduce_``: two launches: one pass from the n received bit rows straight to
  c_s = a/n + f (stored in f) with one fp64 partial sum of c_s² per 1024-element block, t
  finished by its last block; then the worker's pack kernel in place on f.
- ``server_stages``: the same three kernels with the chunk cut into ranges, for the pipelined
  allreduce: the server kernel averages one range (offset, length) as its bits arrive and
  writes that range's block partials; t is reduced from all of them once every range is in;
  the pack kernel runs range by range. A block's partial is summed in one fixed order whatever
  the launch, so f, the bits and t equal ``server_reduce_``'s bit for bit.
- ``unpack_scaled_``: one pass y = t_j·sgn(bit) into the output buffer.

Every kernel is launched on torch's current stream of the tensor's device, so the work is
ordered with the surrounding torch operations and nothing synchronises the device. Results are
bit-identical to the CPU kernels given the same scales (explicit round-to-nearest fp32
intrinsics, no FMA contraction); s and t are reduced in fp64 and agree with the CPU path's to an
ulp.

The host's cost per call is what sizes a bucket can be before the GPU waits for Python, so a
call does as little as it can: tensors are passed as raw device pointers (no DLPack), the
compiled functions, the stream handle and a small workspace (the partial sums and the
finished-blocks counter of the norm kernels) are cached per (device, stream) in a
:class:`KernelLauncher`, and the only allocation is the 1-element scale a call returns.

Where the launches go is one injectable object, the *runtime* (:class:`KernelRuntime`): the
device type it serves and a launcher per (device, stream). The default, :class:`CupyRuntime`,
launches CuPy-compiled (NVRTC) functions on torch's current stream. The test suite passes
``tests/cuda_on_cpu``'s ``CpuRuntime`` instead (the same ``cuda_source()`` text compiled by g++
and executed on CPU threads), so every wrapper below runs unchanged without a GPU, and
``experiments/kernels/host_cost.py`` times :class:`CupyRuntime` itself on a driver whose
launches do nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from commopt.kernels.cupy_runtime import THREADS, CupyRuntime, KernelLauncher, KernelRuntime
from commopt.kernels.torch_kernels import TorchKernels

if TYPE_CHECKING:
    from commopt.kernels.protocol import ServerStages

__all__ = ["CupyKernels", "CupyServerStages", "server_blocks"]

# At most this many blocks for a reduction: a fixed cap (not derived from the device), so the
# fp64 partial sums, and thus s and t, are the same on every GPU for the same input.
_MAX_BLOCKS = 4096
_MAX_GRID_Y = 65535
# Elements per partial sum of the server kernel (COMMOPT_SERVER_BLOCK in cuda/server.cu): the
# partials of a server chunk are the same whether it is averaged in one launch or range by range
# (ranges starting at multiples of this), so t is too. Divides commopt.pipelined.ALIGN.
_SERVER_BLOCK = 1024
_F32 = torch.float32


def server_blocks(length: int) -> int:
    """How many element blocks (partial sums) the server kernel has for ``length`` elements."""
    return -(-length // _SERVER_BLOCK)


def _grid(threads: int) -> tuple[int]:
    """Blocks for one thread per unit of work, at most ``_MAX_BLOCKS`` (the loops grid-stride)."""
    return (max(1, min(_MAX_BLOCKS, -(-threads // THREADS))),)


def _server_grid(length: int) -> tuple[int]:
    """One CUDA block per two element blocks of the server kernel, at most ``_MAX_BLOCKS``."""
    return (max(1, min(_MAX_BLOCKS, -(-server_blocks(length) // 2))),)


class CupyKernels:
    r"""CUDA kernels for SPEC §1 steps 1–4, 6–7, 9, bit-identical to the CPU kernels.

    Tensors that are not contiguous tensors of the runtime's device type (CUDA) and of the
    expected dtypes go to :class:`TorchKernels` instead, so every call is answered.

    Args:
        runtime: where to launch; ``None`` means :class:`~commopt.kernels.cupy_runtime.CupyRuntime`
            (CuPy on the GPU).

    Raises:
        ImportError: ``runtime`` is ``None`` and CuPy is not installed.
    """

    name = "cupy"

    def __init__(self, runtime: KernelRuntime | None = None) -> None:
        self.runtime: KernelRuntime = runtime if runtime is not None else CupyRuntime()
        self.reference = TorchKernels()
        self._device_type = self.runtime.device_type

    def takes(self, *tensors: torch.Tensor) -> bool:
        """Whether every tensor is a contiguous tensor of the runtime's device type."""
        kind = self._device_type
        return all(t.device.type == kind and t.is_contiguous() for t in tensors)

    def _norm(
        self, name: str, x: torch.Tensor, e: torch.Tensor, c: torch.Tensor | None
    ) -> torch.Tensor:
        n = e.numel()
        grid = _grid(-(-n // 4))  # 4 elements per thread
        launch = self.runtime.launcher(e)
        partial, done = launch.workspace(grid[0])
        out = torch.empty(1, dtype=_F32, device=e.device)
        head = (x, np.int64(x.numel()), e) if c is None else (x, np.int64(x.numel()), e, c)
        launch("worker.cu", name, grid, (*head, np.int64(n), partial, done, out))
        return out

    def compensate(
        self, x: torch.Tensor, worker_error: torch.Tensor, c: torch.Tensor
    ) -> torch.Tensor:
        r"""Steps 1–2: c = pad(x) + e; return s = ‖c‖₂/√N (1-element fp32 tensor, on the device)."""
        dtypes = (x.dtype, worker_error.dtype, c.dtype)
        if not (self.takes(x, worker_error, c) and dtypes == (_F32, _F32, _F32)):
            return self.reference.compensate(x, worker_error, c)
        return self._norm("commopt_compensate", x, worker_error, c)

    def scale(self, x: torch.Tensor, worker_error: torch.Tensor) -> torch.Tensor:
        r"""Steps 1–2 without storing c: s = ‖pad(x) + e‖₂/√N (1-element fp32, on the device)."""
        if not (self.takes(x, worker_error) and x.dtype == worker_error.dtype == _F32):
            return self.reference.scale(x, worker_error)
        return self._norm("commopt_scale", x, worker_error, None)

    def pack_compensated_(
        self, x: torch.Tensor, s: torch.Tensor, worker_error: torch.Tensor, bits: torch.Tensor
    ) -> None:
        r"""Steps 1, 3–4 in one pass: c = pad(x) + e; bits = pack(c ≥ 0); e ← c − s·sgn(c)."""
        s = s.to(device=worker_error.device, dtype=_F32).reshape(1)
        if not (self.takes(x, s, worker_error, bits) and x.dtype == worker_error.dtype == _F32):
            return self.reference.pack_compensated_(x, s, worker_error, bits)
        n = worker_error.numel()
        self.runtime.launcher(worker_error)(
            "worker.cu",
            "commopt_pack_compensated",
            _grid(n // 4),
            (x, np.int64(x.numel()), s, worker_error, bits, np.int64(n)),
        )
        return None

    def pack_worker_(
        self, c: torch.Tensor, s: torch.Tensor, worker_error: torch.Tensor, bits: torch.Tensor
    ) -> None:
        r"""Steps 3–4: bits = pack(c ≥ 0) MSB first; e ← c − s·sgn(c)."""
        s = s.to(device=c.device, dtype=_F32).reshape(1)
        if not (self.takes(c, s, worker_error, bits) and c.dtype == worker_error.dtype == _F32):
            return self.reference.pack_worker_(c, s, worker_error, bits)
        pack_update(self.runtime.launcher(c), c, s, worker_error, bits)
        return None

    def server_reduce_(
        self,
        recv_bits: torch.Tensor,
        scales: torch.Tensor,
        server_error: torch.Tensor,
        bits: torch.Tensor,
    ) -> torch.Tensor:
        r"""Steps 6–7: a = (Σ_i s_i·sgn_i)/n in rank order; c_s = a + f; t = ‖c_s‖₂/√M;
        bits = pack(c_s ≥ 0); f ← c_s − t·sgn(c_s). Returns t (on the device)."""
        if not (
            self.takes(recv_bits, scales, server_error, bits)
            and scales.dtype == server_error.dtype == _F32
        ):
            return self.reference.server_reduce_(recv_bits, scales, server_error, bits)
        m = server_error.numel()
        launch = self.runtime.launcher(server_error)
        partial, done = launch.workspace(server_blocks(m))
        t = torch.empty(1, dtype=_F32, device=server_error.device)
        server_average(launch, recv_bits, scales, 0, server_error, partial, (done, t))
        pack_update(launch, server_error, t, server_error, bits)  # f holds c_s: in place
        return t

    def server_stages(self, server_error: torch.Tensor) -> ServerStages:
        """:meth:`server_reduce_` in stages over ranges of f, for the pipelined allreduce (see
        :class:`commopt.kernels.ServerStages`); ranges start at multiples of 1024 elements."""
        if not (self.takes(server_error) and server_error.dtype == _F32):
            return self.reference.server_stages(server_error)
        return CupyServerStages(self, server_error)

    def guard_denominator_(
        self,
        out: torch.Tensor,
        m: torch.Tensor,
        d: torch.Tensor,
        bound: float,
        where: torch.Tensor,
    ) -> None:
        """The step guard on the elements ``where``: torch's indexing, already one gather and
        one scatter on the GPU (see :meth:`TorchKernels.guard_denominator_`)."""
        self.reference.guard_denominator_(out, m, d, bound, where)

    def unpack_scaled_(self, bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        r"""Step 9: out = concat_j t_j·sgn(bits_j), first out.numel() elements."""
        if not (self.takes(bits, scales, out) and scales.dtype == out.dtype == _F32):
            return self.reference.unpack_scaled_(bits, scales, out)
        n, chunk_bytes = bits.shape
        n_true = out.numel()
        if n_true == 0:
            return None
        rows_bytes = min(chunk_bytes, -(-n_true // 8))  # one thread per byte of a row
        grid = (_grid(rows_bytes)[0], min(n, _MAX_GRID_Y))
        self.runtime.launcher(out)(
            "unpack.cu",
            "commopt_unpack_scaled",
            grid,
            (bits, scales, np.int32(n), np.int64(chunk_bytes), np.int64(n_true), out),
        )
        return None


def pack_update(
    launch: KernelLauncher, c: torch.Tensor, s: torch.Tensor, e: torch.Tensor, bits: torch.Tensor
) -> None:
    """``commopt_pack_update``: bits = pack(c ≥ 0); e ← c − s·sgn(c) (c may be e)."""
    n = c.numel()
    launch("worker.cu", "commopt_pack_update", _grid(n // 4), (c, s, e, bits, np.int64(n)))


def server_average(
    launch: KernelLauncher,
    recv_bits: torch.Tensor,
    scales: torch.Tensor,
    lo: int,
    server_error: torch.Tensor,
    partial: object,
    finish: tuple[object, torch.Tensor] | None,
) -> None:
    """``commopt_server_average``: f[lo : lo + 8·recv_bits.shape[1]] ← c_s and the partial sums
    of its element blocks; with ``finish = (done, t)`` (the whole chunk) also t."""
    n, row_bytes = recv_bits.shape
    length = 8 * row_bytes
    done, t = finish if finish is not None else (np.uint64(0), np.uint64(0))
    launch(
        "server.cu",
        "commopt_server_average",
        _server_grid(length),
        (
            recv_bits,
            scales,
            np.int32(n),
            np.int64(lo),
            np.int64(length),
            server_error,
            partial,
            done,
            t,
        ),
    )


class CupyServerStages:
    r"""Steps 6–7 of one server chunk f in stages; equal to one ``server_reduce_`` bit for bit.

    ``average_`` runs ``commopt_server_average`` on one range, which writes the fp64 Σ c_s² of
    each 1024-element block of the range into this chunk's partial sums; ``scale`` reduces all
    of them with ``commopt_finish_rms``, the same reduction ``server_reduce_``'s last block
    runs after averaging the whole chunk in one launch. Each block's sum is taken in one fixed
    order whatever the launch, so the partials, and t, are the same bits however the chunk was
    cut. ``pack_`` is the worker's pack-and-update kernel in place on one range of f.

    Raises:
        ValueError: a range that does not start at a multiple of :attr:`align`, ends neither at
            a multiple of it nor at the end of f, overlaps one averaged before or lies outside
            f; or ``scale()`` before every element of f was averaged.
    """

    align = _SERVER_BLOCK

    def __init__(self, kernels: CupyKernels, server_error: torch.Tensor) -> None:
        self.f = server_error
        self._kernels = kernels
        m = server_error.numel()
        # Its own partial sums (not the launcher's workspace): they live across launches. NaN
        # until averaged: a block left out would make t NaN rather than plausible.
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
        hi = self._range(lo, 8 * recv_bits.shape[1], "stage")
        if any(lo < b and a < hi for a, b in self._averaged.items()):
            raise ValueError(f"server stage range [{lo}, {hi}) was averaged already")
        self._averaged[lo] = hi
        device = self.f.device
        recv_bits = recv_bits.to(device=device).contiguous()
        scales = scales.to(device=device, dtype=_F32).contiguous()
        launch = self._kernels.runtime.launcher(self.f)
        server_average(launch, recv_bits, scales, lo, self.f, self._partial, None)

    def scale(self) -> torch.Tensor:
        """t = ‖c_s‖₂/√M (1-element fp32, on the device) once every element has been averaged."""
        m = self.f.numel()
        done = sum(hi - lo for lo, hi in self._averaged.items())
        if done != m:
            raise ValueError(f"server scale() after averaging {done} of the chunk's {m} elements")
        t = torch.empty(1, dtype=_F32, device=self.f.device)
        self._kernels.runtime.launcher(self.f)(
            "worker.cu",
            "commopt_finish_rms",
            (1,),
            (self._partial, np.int64(server_blocks(m)), np.int64(m), t),
        )
        return t

    def pack_(self, t: torch.Tensor, lo: int, bits: torch.Tensor) -> None:
        """bits = pack(c_s ≥ 0) and f ← c_s − t·sgn(c_s) on f[lo : lo + 8·bits.numel()]."""
        hi = self._range(lo, 8 * bits.numel(), "pack")
        t = t.to(device=self.f.device, dtype=_F32).reshape(1)
        out = bits if self._kernels.takes(bits) else torch.empty_like(bits, device=self.f.device)
        c_s = self.f[lo:hi]
        pack_update(self._kernels.runtime.launcher(self.f), c_s, t, c_s, out)
        if out is not bits:
            bits.copy_(out)
