r"""Execute commopt's CUDA C kernels on the CPU: the exact ``cuda_source()`` text, compiled by g++.

There is no GPU on this project's machines or in CI, so the kernels in ``cuda/`` are verified by
running them here: :func:`compile_source` compiles a source with ``cuda_on_cpu.h`` (beside this
file; it documents how each CUDA construct maps onto OS threads) into a shared library, cached
by a hash of everything that goes into it, and loads it with ctypes. :class:`CpuRuntime` plugs
that into :class:`commopt.kernels.cupy_kernels.CupyKernels` in place of CuPy, so the real
launch wrappers (grid sizes, argument types) run unchanged on CPU tensors::

    from commopt.kernels.cupy_kernels import CupyKernels
    kernels = CupyKernels(runtime=CpuRuntime())   # numpy arrays, g++-compiled kernels

Launches check their arguments against the kernel's C signature (count, scalar widths and
kinds, array element sizes): a wrapper passing ``np.int32`` where the kernel takes
``long long`` raises :class:`TypeError` here, where a GPU would silently read garbage.

Test-only on purpose: it lives under ``tests/`` and is not shipped in the wheel. Nobody should
run the CUDA kernels on a CPU for speed (256 OS threads per block are far slower than the
numba kernels); it exists so the CUDA text is executed and checked bit for bit in CI.

The compiled libraries go to ``$COMMOPT_CUDA_ON_CPU_CACHE`` or ``<tmp>/commopt-cuda-on-cpu-<uid>``;
each variant (source text × header × flags × compiler version) is compiled once per machine.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from commopt.kernels.cuda_sources import cuda_source
from commopt.kernels.cupy_runtime import THREADS

__all__ = [
    "FLAGS",
    "HEADER",
    "CpuKernel",
    "CpuModule",
    "CpuRuntime",
    "KernelLaunchError",
    "compile_source",
]

HEADER = Path(__file__).with_name("cuda_on_cpu.h")
#: -ffp-contract=off: never fuse a*b+c into one rounding (the __f*_rn intrinsics forbid it on
#: the GPU too); -fno-fast-math keeps IEEE semantics (signed zeros, NaN compares, no reassoc).
#: -Wall -Wextra -Werror: CI has no nvcc, so this is where a warning in cuda/ fails the build.
#: -fsanitize=alignment: a float4 access at an address that is not 16-byte aligned aborts, as it
#: faults on a GPU (the kernels must fall back to scalar accesses there).
FLAGS = (
    "-std=c++17",
    "-O1",
    "-fPIC",
    "-shared",
    "-pthread",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-fno-strict-aliasing",
    "-fsanitize=alignment",
    "-fno-sanitize-recover=alignment",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-unused-function",
)
_ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(')
# numpy dtype kinds -> the header's kind_of() codes (1 signed, 2 unsigned, 3 float, 4 bool).
_KINDS = {"i": 1, "u": 2, "f": 3, "b": 4}
_C_NAMES = {1: "signed integer", 2: "unsigned integer", 3: "floating point", 4: "bool"}


class KernelLaunchError(RuntimeError):
    """The kernel ran but broke a CUDA rule the execution model checks (see cuda_on_cpu.h)."""


def cache_dir() -> Path:
    """Where compiled kernels are kept between runs."""
    configured = os.environ.get("COMMOPT_CUDA_ON_CPU_CACHE")
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / f"commopt-cuda-on-cpu-{os.getuid()}"


@functools.cache
def _compiler() -> tuple[str, str]:
    """The C++ compiler ($CXX or g++) and its version text (part of the cache key)."""
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("running the CUDA kernels on the CPU needs g++: apt-get install g++")
    version = subprocess.run(
        [cxx, "--version"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return cxx, version


def translation_unit(source: str, name: str = "kernel.cu") -> tuple[str, list[str]]:
    """The C++ text g++ compiles for ``source``, and the kernel names it exports.

    The header, then ``source`` verbatim (``#line`` keeps its own line numbers in messages),
    then one ``CUDA_ON_CPU_EXPORT`` per ``extern "C" __global__`` entry.
    """
    entries = _ENTRY.findall(source)
    if not entries:
        raise ValueError(f'{name} has no extern "C" __global__ entry point')
    exports = "".join(f"CUDA_ON_CPU_EXPORT({entry})\n" for entry in entries)
    return f'#include "{HEADER}"\n#line 1 "{name}"\n{source}\n{exports}', entries


_loaded: dict[str, CpuModule] = {}


def compile_source(
    source: str, *, name: str = "kernel.cu", jitter: bool = False, fibers: bool = False
) -> CpuModule:
    """Compile (or load from the cache) one CUDA C source for the CPU.

    Args:
        source: self-contained CUDA C text, e.g. ``cuda_source("worker.cu")`` (possibly mutated).
        name: the file name compiler messages and launch errors quote.
        jitter: build with ``-DCUDA_ON_CPU_JITTER=1``: random yields and sleeps at every block
            start, barrier and warp intrinsic (seeded by :meth:`CpuModule.seed`).
        fibers: build with ``-DCUDA_ON_CPU_FIBERS=1``: the block's CUDA threads are ucontext
            fibers on the calling thread instead of OS threads (the same barriers and checks,
            ~18x less CPU time; with ``jitter`` the fiber order is random).

    Raises:
        RuntimeError: g++ is missing or rejected the source (its messages included).
    """
    cxx, version = _compiler()
    flags = [
        *FLAGS,
        *(["-DCUDA_ON_CPU_JITTER=1"] if jitter else []),
        *(["-DCUDA_ON_CPU_FIBERS=1"] if fibers else []),
    ]
    unit, entries = translation_unit(source, name)
    key = hashlib.sha256(
        "\0".join([unit, HEADER.read_text(), " ".join(flags), cxx, version]).encode()
    ).hexdigest()[:32]
    if key in _loaded:
        return _loaded[key]
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    library = folder / f"{key}.so"
    if not library.exists():
        # Build in a private folder, then rename: concurrent builders (forked ranks, parallel
        # test runs) never load a half-written library.
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            cpp, built = Path(tmp) / f"{key}.cpp", Path(tmp) / f"{key}.so"
            cpp.write_text(unit)
            proc = subprocess.run(
                [cxx, *flags, "-o", str(built), str(cpp)],
                capture_output=True,
                text=True,
                timeout=600,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"g++ could not compile {name} for the CPU:\n{proc.stderr}")
            os.replace(built, library)
    module = CpuModule(ctypes.CDLL(str(library)), entries, name)
    _loaded[key] = module
    return module


class CpuModule:
    """A compiled source: ``get_function(name)`` as on ``cupy.RawModule``."""

    def __init__(self, library: ctypes.CDLL, entries: Sequence[str], name: str) -> None:
        self._library = library
        self.name = name
        self.entries = tuple(entries)
        self._functions: dict[str, CpuKernel] = {}

    def get_function(self, name: str) -> CpuKernel:
        if name not in self.entries:
            raise AttributeError(f"{self.name} has no kernel {name!r}; it has {self.entries}")
        if name not in self._functions:
            self._functions[name] = CpuKernel(self._library, name)
        return self._functions[name]

    def seed(self, seed: int) -> None:
        """Seed the random scheduling of a ``jitter=True`` build (no effect otherwise)."""
        self._library.cuda_on_cpu_seed(ctypes.c_uint(seed))


def _dim3(value: int | Sequence[int], what: str) -> ctypes.Array:
    dims = (value,) if isinstance(value, int | np.integer) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(int(d) < 0 for d in dims):
        raise ValueError(f"{what} must be 1 to 3 non-negative sizes, got {value!r}")
    return (ctypes.c_uint * 3)(*(int(d) for d in dims), *(1,) * (3 - len(dims)))


class CpuKernel:
    """One kernel, launched like ``cupy.RawKernel``: ``kernel(grid, block, args)``.

    Arrays (numpy) are passed as their data pointers, numpy scalars by value; each is checked
    against the C parameter it lands in. Python ints and floats are refused: CuPy would pick a
    width for them, and the wrappers must say which one they mean. A pointer parameter also
    takes an ``np.uint64`` (a raw address, as the CuPy runtime passes it; 0 is a null pointer),
    unchecked but for its width.
    """

    def __init__(self, library: ctypes.CDLL, name: str) -> None:
        self.name = name
        self._launch = getattr(library, f"cuda_on_cpu_launch_{name}")
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [
            ctypes.POINTER(ctypes.c_uint),
            ctypes.POINTER(ctypes.c_uint),
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        signature = getattr(library, f"cuda_on_cpu_signature_{name}")
        signature.restype = ctypes.c_int
        sizes, kinds = ctypes.POINTER(ctypes.c_int)(), ctypes.POINTER(ctypes.c_int)()
        count = signature(ctypes.byref(sizes), ctypes.byref(kinds))
        #: (size in bytes — of an element for a pointer —, kind) per parameter.
        self.params = [(sizes[i], kinds[i]) for i in range(count)]

    def _holder(self, index: int, arg: Any) -> Any:
        size, kind = self.params[index]
        where = f"{self.name} argument {index}"
        if kind >= 10:
            if isinstance(arg, np.uint64):
                return ctypes.c_void_p(int(arg))
            if not isinstance(arg, np.ndarray):
                raise TypeError(f"{where} is a pointer; got {type(arg).__name__}, not an array")
            if arg.dtype.itemsize != size or _KINDS.get(arg.dtype.kind) != kind - 10:
                raise TypeError(
                    f"{where} points to a {size}-byte {_C_NAMES.get(kind - 10)}; "
                    f"got an array of {arg.dtype}"
                )
            return ctypes.c_void_p(arg.ctypes.data)
        if not isinstance(arg, np.generic):
            raise TypeError(
                f"{where} is a {size}-byte {_C_NAMES.get(kind)}; pass a numpy scalar of that "
                f"width, not {type(arg).__name__}"
            )
        if arg.dtype.itemsize != size or _KINDS.get(arg.dtype.kind) != kind:
            raise TypeError(f"{where} is a {size}-byte {_C_NAMES.get(kind)}; got {arg.dtype}")
        return ctypes.create_string_buffer(arg.tobytes(), size)

    def __call__(
        self, grid: int | Sequence[int], block: int | Sequence[int], args: Sequence[Any]
    ) -> None:
        if len(args) != len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} arguments, got {len(args)}")
        holders = [self._holder(i, arg) for i, arg in enumerate(args)]
        pointers = (ctypes.c_void_p * max(1, len(holders)))(*(ctypes.addressof(h) for h in holders))
        error = ctypes.create_string_buffer(1024)
        status = self._launch(
            _dim3(grid, "grid"), _dim3(block, "block"), pointers, error, len(error)
        )
        if status != 0:
            raise KernelLaunchError(
                f"{self.name}<<<{grid}, {block}>>>: {error.value.decode(errors='replace')}"
            )


class _CpuLauncher:
    """The runtime's one launcher (one CPU "device", no streams): tensors become numpy arrays."""

    def __init__(self, runtime: CpuRuntime) -> None:
        self._runtime = runtime
        self._partial = np.zeros(0)
        self._done = np.zeros(1, dtype=np.uint32)

    def workspace(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        # Kept across calls, like the CUDA launcher's: a kernel that left the counter non-zero
        # breaks the next call. NaN-filled when grown: a partial read before written shows.
        if self._partial.size < count:
            self._partial = np.full(count, np.nan)
        return self._partial, self._done

    def __call__(self, source: str, name: str, grid: tuple[int, ...], args: Sequence[Any]) -> None:
        function = self._runtime.module(source).get_function(name)
        self._runtime.launches.append((name, tuple(grid), (THREADS,)))
        arrays = [a if isinstance(a, np.generic | np.ndarray) else a.detach().numpy() for a in args]
        function(grid, (THREADS,), arrays)


class CpuRuntime:
    """The runtime :class:`~commopt.kernels.cupy_kernels.CupyKernels` launches on, for CPU tensors.

    Tensors are handed to the kernels as numpy arrays (so every pointer argument is checked
    against the kernel's C signature), and each source is compiled by :func:`compile_source`.
    ``source`` maps a file name to its text (default
    :func:`commopt.kernels.cuda_sources.cuda_source`; the mutation tests pass broken text).
    """

    device_type = "cpu"

    def __init__(
        self,
        *,
        fibers: bool = False,
        jitter: bool = False,
        source: Callable[[str], str] = cuda_source,
        seed: int = 0,
    ) -> None:
        self._fibers = fibers
        self._jitter = jitter
        self._source = source
        self._seed = seed
        self.launches: list[tuple[str, tuple, tuple]] = []  # (kernel, grid, block), in order
        self._launcher = _CpuLauncher(self)

    def module(self, source: str) -> CpuModule:
        module = compile_source(
            self._source(source), name=source, jitter=self._jitter, fibers=self._fibers
        )
        if self._jitter:
            module.seed(self._seed)
        return module

    def launcher(self, tensor: torch.Tensor) -> _CpuLauncher:
        del tensor  # one CPU "device"; no stream to order against
        return self._launcher
