r"""The per-element work of the compressed allreduce on CUDA: CuPy-compiled kernels from ``cuda/``.

The CUDA C sources live in the repository's top-level ``cuda/`` folder (``worker.cu``,
``server.cu``, ``unpack.cu``) and ship inside the wheel as ``commopt/cuda/*.cu``; CuPy's
``RawModule`` compiles them with NVRTC on first use (and caches the binary on disk). Each
:class:`CupyKernels` call is a handful of kernel launches:

- ``compensate``: one fused pass c = pad(x) + e with per-block fp64 partial sums of c², then one
  single-block kernel that reduces the partials in a fixed order to s = √(Σc²)/√N. ``scale``
  is the same without storing c, and ``pack_compensated_`` recomputes c while it packs (the
  pair :func:`commopt.compressed_allreduce` uses: no N-element temporary).
- ``pack_worker_``: one pass; a warp ballot packs 32 signs into 4 bytes, MSB first, while each
  thread writes e ← c − s·sgn(c). s is read on the device: no host round trip.
- ``server_reduce_``: one pass from the n received bit rows straight to c_s = a/n + f (stored in
  f) with one fp64 partial sum of c_s² per 1024-element block, the same reduction to t, then the
  worker's pack kernel in place on f.
- ``server_stages``: the same three kernels with the chunk cut into ranges, for the pipelined
  allreduce: the server kernel averages one range (offset, length) as its bits arrive and
  writes that range's block partials; t is reduced from all of them once every range is in;
  the pack kernel runs range by range. A block's partial is summed in one fixed order whatever
  the launch, so f, the bits and t equal ``server_reduce_``'s bit for bit.
- ``unpack_scaled_``: one pass y = t_j·sgn(bit) into the output buffer.

Tensors go to CuPy through DLPack (zero copy) and every kernel is launched on torch's current
stream of the tensor's device (``cupy.cuda.ExternalStream``), so the work is ordered with the
surrounding torch operations and nothing synchronises the device. Results are bit-identical to
the CPU kernels given the same scales (explicit round-to-nearest fp32 intrinsics, no FMA
contraction); s and t are reduced in fp64 and agree with the CPU path's to an ulp.

Where the launches go is one injectable object, the *runtime* (:class:`KernelRuntime`): its
array module, the device type it serves and a launch context that hands out compiled kernels.
The default, :class:`CupyRuntime`, is CuPy + ``RawModule`` on torch's current stream. The test
suite passes ``tests/cuda_on_cpu``'s ``CpuRuntime`` instead (numpy + the same ``cuda_source()``
text compiled by g++ and executed on CPU threads), so every wrapper below runs unchanged
without a GPU.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from commopt.kernels.cuda_sources import cuda_source
from commopt.kernels.cupy_server_stages import CupyServerStages, server_blocks
from commopt.kernels.torch_kernels import TorchKernels

if TYPE_CHECKING:
    from commopt.kernels import ServerStages

__all__ = ["CupyKernels", "CupyRuntime", "KernelLaunch", "KernelRuntime"]

# Threads per block; the reducing kernels are written for exactly this (COMMOPT_THREADS).
_THREADS = 256
# At most this many blocks for a reduction: a fixed cap (not derived from the device), so the
# fp64 partial sums, and thus s and t, are the same on every GPU for the same input.
_MAX_BLOCKS = 4096
_MAX_GRID_Y = 65535


class KernelLaunch(Protocol):
    """One call's launch context: ``with runtime.launch(t) as launch: launch.kernel(...)``."""

    def __enter__(self) -> KernelLaunch: ...

    def __exit__(self, *exc: object) -> None: ...

    def kernel(self, source: str, name: str) -> Any:
        """Kernel ``name`` of ``cuda/<source>``, called as ``kernel(grid, block, args)``."""


class KernelRuntime(Protocol):
    """Where :class:`CupyKernels` launches: an array module, a device type, launch contexts."""

    #: The array module tensors are handed to through DLPack (``cupy``; ``numpy`` for the CPU).
    xp: Any
    #: Tensors on this device type (``"cuda"``) are launched; others go to TorchKernels.
    device_type: str

    def launch(self, tensor: torch.Tensor) -> AbstractContextManager[KernelLaunch]: ...


@functools.cache
def _module(name: str, device_index: int) -> Any:
    """The compiled module for one source on one device (compiled once per process)."""
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=cuda_source(name))
        module.compile()
    return module


def _blocks(work: int) -> int:
    return max(1, min(_MAX_BLOCKS, -(-work // _THREADS)))


class _CupyLaunch:
    """Device + stream context for one call: torch's current stream on the tensor's device."""

    def __init__(self, cupy: Any, tensor: torch.Tensor) -> None:
        self.index = (
            tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
        )
        self.device = cupy.cuda.Device(self.index)
        self.stream = cupy.cuda.ExternalStream(
            torch.cuda.current_stream(tensor.device).cuda_stream, self.index
        )

    def __enter__(self) -> _CupyLaunch:
        self.device.__enter__()
        self.stream.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stream.__exit__(*exc)
        self.device.__exit__(*exc)

    def kernel(self, source: str, name: str) -> Any:
        return _module(source, self.index).get_function(name)


class CupyRuntime:
    """The real runtime: CuPy arrays, NVRTC-compiled ``RawModule``s, torch's current stream.

    Raises:
        ImportError: CuPy is not installed.
    """

    device_type = "cuda"

    def __init__(self) -> None:
        try:
            import cupy
        except ImportError as err:
            raise ImportError("CupyKernels needs CuPy: pip install 'commopt[cuda]'") from err
        self.xp = cupy

    def launch(self, tensor: torch.Tensor) -> _CupyLaunch:
        return _CupyLaunch(self.xp, tensor)


class CupyKernels:
    r"""CUDA kernels for SPEC §1 steps 1–4, 6–7, 9, bit-identical to the CPU kernels.

    Tensors that are not contiguous tensors of the runtime's device type (CUDA) and of the
    expected dtypes go to :class:`TorchKernels` instead, so every call is answered.

    Args:
        runtime: where to launch; ``None`` means :class:`CupyRuntime` (CuPy on the GPU).

    Raises:
        ImportError: ``runtime`` is ``None`` and CuPy is not installed.
    """

    name = "cupy"

    def __init__(self, runtime: KernelRuntime | None = None) -> None:
        self._runtime = runtime if runtime is not None else CupyRuntime()
        self._reference = TorchKernels()

    def _cp(self, t: torch.Tensor) -> Any:
        """Zero-copy view of a tensor in the runtime's array module, through DLPack (inside a
        launch context, so on torch's stream)."""
        return self._runtime.xp.from_dlpack(t.detach())

    def _plain(self, *tensors: torch.Tensor) -> bool:
        kind = self._runtime.device_type
        return all(t.device.type == kind and t.is_contiguous() for t in tensors)

    def _rms(
        self,
        launch: KernelLaunch,
        partial: torch.Tensor,
        blocks: int,
        numel: int,
        out: torch.Tensor,
    ) -> None:
        launch.kernel("worker.cu", "commopt_finish_rms")(
            (1,), (_THREADS,), (self._cp(partial), np.int32(blocks), np.int64(numel), self._cp(out))
        )

    def compensate(
        self, x: torch.Tensor, worker_error: torch.Tensor, c: torch.Tensor
    ) -> torch.Tensor:
        r"""Steps 1–2: c = pad(x) + e; return s = ‖c‖₂/√N (1-element fp32 tensor, on the device)."""
        if not (
            self._plain(x, worker_error, c)
            and x.dtype == worker_error.dtype == c.dtype == torch.float32
        ):
            return self._reference.compensate(x, worker_error, c)
        n = c.numel()
        blocks = _blocks(n)
        partial = torch.empty(blocks, dtype=torch.float64, device=c.device)
        s = torch.empty(1, dtype=torch.float32, device=c.device)
        with self._runtime.launch(c) as launch:
            launch.kernel("worker.cu", "commopt_compensate")(
                (blocks,),
                (_THREADS,),
                (
                    self._cp(x),
                    np.int64(x.numel()),
                    self._cp(worker_error),
                    self._cp(c),
                    np.int64(n),
                    self._cp(partial),
                ),
            )
            self._rms(launch, partial, blocks, n, s)
        return s

    def scale(self, x: torch.Tensor, worker_error: torch.Tensor) -> torch.Tensor:
        r"""Steps 1–2 without storing c: s = ‖pad(x) + e‖₂/√N (1-element fp32, on the device)."""
        if not (self._plain(x, worker_error) and x.dtype == worker_error.dtype == torch.float32):
            return self._reference.scale(x, worker_error)
        n = worker_error.numel()
        blocks = _blocks(n)
        partial = torch.empty(blocks, dtype=torch.float64, device=x.device)
        s = torch.empty(1, dtype=torch.float32, device=x.device)
        with self._runtime.launch(worker_error) as launch:
            launch.kernel("worker.cu", "commopt_scale")(
                (blocks,),
                (_THREADS,),
                (
                    self._cp(x),
                    np.int64(x.numel()),
                    self._cp(worker_error),
                    np.int64(n),
                    self._cp(partial),
                ),
            )
            self._rms(launch, partial, blocks, n, s)
        return s

    def pack_compensated_(
        self, x: torch.Tensor, s: torch.Tensor, worker_error: torch.Tensor, bits: torch.Tensor
    ) -> None:
        r"""Steps 1, 3–4 in one pass: c = pad(x) + e; bits = pack(c ≥ 0); e ← c − s·sgn(c)."""
        s = s.to(device=worker_error.device, dtype=torch.float32).reshape(1)
        if not (
            self._plain(x, s, worker_error, bits) and x.dtype == worker_error.dtype == torch.float32
        ):
            return self._reference.pack_compensated_(x, s, worker_error, bits)
        n = worker_error.numel()
        with self._runtime.launch(worker_error) as launch:
            launch.kernel("worker.cu", "commopt_pack_compensated")(
                (_blocks(n),),
                (_THREADS,),
                (
                    self._cp(x),
                    np.int64(x.numel()),
                    self._cp(s),
                    self._cp(worker_error),
                    self._cp(bits),
                    np.int64(n),
                ),
            )
        return None

    def _pack(
        self,
        launch: KernelLaunch,
        c: torch.Tensor,
        s: torch.Tensor,
        e: torch.Tensor,
        bits: torch.Tensor,
    ) -> None:
        n = c.numel()
        launch.kernel("worker.cu", "commopt_pack_update")(
            (_blocks(n),),
            (_THREADS,),
            (self._cp(c), self._cp(s), self._cp(e), self._cp(bits), np.int64(n)),
        )

    def pack_worker_(
        self, c: torch.Tensor, s: torch.Tensor, worker_error: torch.Tensor, bits: torch.Tensor
    ) -> None:
        r"""Steps 3–4: bits = pack(c ≥ 0) MSB first; e ← c − s·sgn(c)."""
        s = s.to(device=c.device, dtype=torch.float32).reshape(1)
        if not (
            self._plain(c, s, worker_error, bits) and c.dtype == worker_error.dtype == torch.float32
        ):
            return self._reference.pack_worker_(c, s, worker_error, bits)
        with self._runtime.launch(c) as launch:
            self._pack(launch, c, s, worker_error, bits)
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
            self._plain(recv_bits, scales, server_error, bits)
            and scales.dtype == server_error.dtype == torch.float32
        ):
            return self._reference.server_reduce_(recv_bits, scales, server_error, bits)
        m, dev = server_error.numel(), server_error.device
        partial = torch.empty(max(1, server_blocks(m)), dtype=torch.float64, device=dev)
        t = torch.empty(1, dtype=torch.float32, device=dev)
        with self._runtime.launch(server_error) as launch:
            self._server_average(launch, recv_bits, scales, 0, server_error, partial)
            self._rms(launch, partial, server_blocks(m), m, t)
            self._pack(launch, server_error, t, server_error, bits)  # f holds c_s: in place
        return t

    def _server_average(
        self,
        launch: KernelLaunch,
        recv_bits: torch.Tensor,
        scales: torch.Tensor,
        lo: int,
        server_error: torch.Tensor,
        partial: torch.Tensor,
    ) -> None:
        """f[lo : lo + 8·recv_bits.shape[1]] ← c_s, and the partial sums of its element blocks."""
        n, row_bytes = recv_bits.shape
        length = 8 * row_bytes
        launch.kernel("server.cu", "commopt_server_average")(
            (max(1, min(_MAX_BLOCKS, server_blocks(length))),),
            (_THREADS,),
            (
                self._cp(recv_bits),
                self._cp(scales),
                np.int32(n),
                np.int64(lo),
                np.int64(length),
                self._cp(server_error),
                self._cp(partial),
            ),
        )

    def server_stages(self, server_error: torch.Tensor) -> ServerStages:
        """:meth:`server_reduce_` in stages over ranges of f, for the pipelined allreduce (see
        :class:`commopt.kernels.ServerStages`); ranges start at multiples of 1024 elements."""
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
        self._reference.guard_denominator_(out, m, d, bound, where)

    def unpack_scaled_(self, bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        r"""Step 9: out = concat_j t_j·sgn(bits_j), first out.numel() elements."""
        if not (self._plain(bits, scales, out) and scales.dtype == out.dtype == torch.float32):
            return self._reference.unpack_scaled_(bits, scales, out)
        n, chunk_bytes = bits.shape
        n_true = out.numel()
        if n_true == 0:
            return None
        grid = (_blocks(min(8 * chunk_bytes, n_true)), min(n, _MAX_GRID_Y))
        with self._runtime.launch(out) as launch:
            launch.kernel("unpack.cu", "commopt_unpack_scaled")(
                grid,
                (_THREADS,),
                (
                    self._cp(bits),
                    self._cp(scales),
                    np.int32(n),
                    np.int64(chunk_bytes),
                    np.int64(n_true),
                    self._cp(out),
                ),
            )
        return None
