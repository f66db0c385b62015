r"""Where :class:`~commopt.kernels.cupy_kernels.CupyKernels` launches: a runtime that hands out
one :class:`KernelLauncher` per (device, stream).

A launcher holds everything a call can reuse: the compiled functions, the stream, and a small
workspace (the fp64 partial sums and the finished-blocks counter of the kernels that finish a
norm in their last block). Reusing the workspace is safe because every launch that uses it is
queued on that one stream, so they run one after another, and each leaves the counter at 0.

A call then costs a dictionary look-up, one raw pointer per tensor and one driver launch:
no ``cupy.cuda.Device`` or ``ExternalStream`` context per call, and no DLPack (which
``experiments/kernels/host_cost.py`` measured at 65 % of the wrapper's cost). The device
context is entered only when torch's current device is not the tensor's.

:class:`CupyRuntime` talks to CuPy and torch.cuda through a *driver* object (:class:`CupyDriver`
by default) with five small methods; ``host_cost.py`` passes one whose launches do nothing, so
it times this module's own code, and tests/gpu fakes it on the CPU.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import numpy as np
import torch

from commopt.kernels.cuda_sources import cuda_source

__all__ = ["THREADS", "CupyDriver", "CupyRuntime", "KernelLauncher", "KernelRuntime"]

#: Threads per block; every kernel in cuda/ is written for exactly this (COMMOPT_THREADS).
THREADS = 256
_BLOCK = (THREADS,)
# The workspace's partial sums: at least the most blocks a worker kernel launches (its cap).
_MIN_PARTIALS = 4096


class KernelLauncher(Protocol):
    """Launches on one device and stream."""

    def __call__(self, source: str, name: str, grid: tuple[int, ...], args: tuple) -> None:
        """Launch kernel ``name`` of ``cuda/<source>`` with ``THREADS`` threads per block.

        ``args`` are tensors (passed as device pointers) and numpy scalars (by value), in the
        kernel's parameter order.
        """

    def workspace(self, count: int) -> tuple[Any, Any]:
        """(partial, done) kernel arguments: ≥ ``count`` fp64 partial sums, and a counter at 0."""


class KernelRuntime(Protocol):
    """Where :class:`~commopt.kernels.cupy_kernels.CupyKernels` launches."""

    #: Tensors on this device type (``"cuda"``) are launched; others go to TorchKernels.
    device_type: str

    def launcher(self, tensor: torch.Tensor) -> KernelLauncher:
        """The launcher for the tensor's device and that device's current torch stream."""


@functools.cache
def _module(name: str, device_index: int) -> Any:
    """The compiled module for one source on one device (compiled once per process)."""
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=cuda_source(name))
        module.compile()
    return module


class CupyDriver:
    """What :class:`CupyRuntime` needs of CuPy and torch.cuda, and nothing else.

    Raises:
        ImportError: CuPy is not installed.
    """

    device_type = "cuda"

    def __init__(self) -> None:
        try:
            import cupy
        except ImportError as err:
            raise ImportError("CupyKernels needs CuPy: pip install 'commopt[cuda]'") from err
        self._cupy = cupy
        # The raw cudaStream_t of the current stream without building a torch.cuda.Stream
        # (what torch.cuda.current_stream does, at several µs a call).
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

    def function(self, source: str, name: str, index: int) -> Any:
        """A ``cupy.cuda.function.Function``: ``f(grid, block, args, shared_mem, stream)``."""
        with self._cupy.cuda.Device(index):
            return _module(source, index).get_function(name).kernel

    def current_device(self) -> int:
        """The current CUDA device index."""
        return torch.cuda.current_device()

    def raw_stream(self, index: int) -> int:
        """The current torch stream of device ``index``, as a raw handle."""
        if self._raw_stream is not None:
            return int(self._raw_stream(index))
        return torch.cuda.current_stream(torch.device("cuda", index)).cuda_stream

    def stream(self, handle: int, index: int) -> Any:
        """An object whose ``ptr`` is ``handle``, as CuPy's ``Function`` takes a stream."""
        return self._cupy.cuda.ExternalStream(handle, index)

    def device(self, index: int) -> Any:
        """The CuPy device ``index``."""
        return self._cupy.cuda.Device(index)


class _Launcher:
    """A :class:`KernelLauncher` for one (device, stream) through a :class:`CupyDriver`."""

    def __init__(self, driver: Any, device: torch.device, index: int, handle: int) -> None:
        self._driver = driver
        self._device = device
        self._index = index
        self._stream = driver.stream(handle, index)
        self._functions: dict[str, Any] = {}  # kernel names are unique across cuda/
        self._partial: torch.Tensor | None = None
        self._done: torch.Tensor | None = None
        self._workspace: tuple[Any, Any] = ()

    def workspace(self, count: int) -> tuple[Any, Any]:
        if self._partial is None or self._partial.numel() < count:
            # Allocated on this launcher's stream (the current one during a call), the only
            # stream that ever uses it.
            self._partial = torch.empty(
                max(count, _MIN_PARTIALS), dtype=torch.float64, device=self._device
            )
            if self._done is None:
                self._done = torch.empty(1, dtype=torch.int32, device=self._device)
                self._done.zero_()
            self._workspace = (
                np.uint64(self._partial.data_ptr()),
                np.uint64(self._done.data_ptr()),
            )
        return self._workspace

    def __call__(self, source: str, name: str, grid: tuple[int, ...], args: tuple) -> None:
        function = self._functions.get(name)
        if function is None:
            function = self._functions[name] = self._driver.function(source, name, self._index)
        raw = tuple(a if isinstance(a, np.generic) else np.uint64(a.data_ptr()) for a in args)
        if self._driver.current_device() == self._index:
            function(grid, _BLOCK, raw, 0, self._stream)
        else:
            with self._driver.device(self._index):
                function(grid, _BLOCK, raw, 0, self._stream)


class CupyRuntime:
    """The real runtime: NVRTC-compiled CuPy functions on torch's current stream.

    Args:
        driver: what it calls in CuPy and torch.cuda; ``None`` means :class:`CupyDriver`.

    Raises:
        ImportError: ``driver`` is ``None`` and CuPy is not installed.
    """

    def __init__(self, driver: Any = None) -> None:
        self._driver = driver if driver is not None else CupyDriver()
        self.device_type: str = self._driver.device_type
        self._launchers: dict[tuple[int, int], _Launcher] = {}

    def launcher(self, tensor: torch.Tensor) -> KernelLauncher:
        """The kernel launcher for ``tensor``'s device (built once per device and stream)."""
        device = tensor.device
        index = device.index
        if index is None:
            index = self._driver.current_device()
        key = (index, self._driver.raw_stream(index))
        launcher = self._launchers.get(key)
        if launcher is None:
            launcher = self._launchers[key] = _Launcher(self._driver, device, index, key[1])
        return launcher
