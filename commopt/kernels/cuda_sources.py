"""Where the CUDA C kernels live: ``commopt/cuda/`` in a wheel, ``cuda/`` in a checkout.

Kept apart from :mod:`commopt.kernels.cupy_kernels` so that it imports without CuPy (the
packaging test and the nvcc compile test use it on machines with no GPU).
"""

from __future__ import annotations

import importlib.resources
import re
from pathlib import Path

__all__ = ["CUDA_HEADERS", "CUDA_SOURCES", "cuda_source", "cuda_source_dir"]

#: The kernel sources, one per stage of SPEC §1.
CUDA_SOURCES = ("worker.cu", "server.cu", "unpack.cu")
#: Device helpers more than one source needs, pulled in with ``#include "name"``.
CUDA_HEADERS = ("block_sum.cuh", "vector4.cuh")

_INCLUDE = re.compile(r'^#include "([^"]+)"[ \t]*$', re.MULTILINE)


def cuda_source_dir() -> Path:
    """The folder holding the ``.cu`` sources.

    An installed wheel carries them as package data in ``commopt/cuda/`` (copied there by
    ``setup.py``); an editable install or a plain checkout reads the repository's top-level
    ``cuda/``.

    Raises:
        FileNotFoundError: neither place has them (a broken install); reinstall commopt.
    """
    packaged = importlib.resources.files("commopt").joinpath("cuda")
    if packaged.joinpath(CUDA_SOURCES[0]).is_file():
        return Path(str(packaged))
    checkout = Path(__file__).resolve().parents[2] / "cuda"
    if (checkout / CUDA_SOURCES[0]).is_file():
        return checkout
    raise FileNotFoundError(
        f"commopt's CUDA sources ({', '.join(CUDA_SOURCES)}) are neither in {packaged} "
        f"(installed wheel) nor in {checkout} (source checkout); reinstall commopt"
    )


def cuda_source(name: str) -> str:
    """The self-contained text of one kernel source, e.g. ``cuda_source("worker.cu")``.

    Each ``#include "header"`` line naming one of :data:`CUDA_HEADERS` is replaced by that
    header's text. NVRTC then needs no include path, and CuPy's compile cache, keyed by the
    source text, sees a header change as a new source.

    Raises:
        ValueError: ``name`` is not one of :data:`CUDA_SOURCES`, or it includes a file that is
            not one of :data:`CUDA_HEADERS`.
    """
    if name not in CUDA_SOURCES:
        raise ValueError(f"unknown CUDA source {name!r}; expected one of {CUDA_SOURCES}")
    folder = cuda_source_dir()

    def paste(match: re.Match[str]) -> str:
        header = match.group(1)
        if header not in CUDA_HEADERS:
            raise ValueError(f"{name} includes {header!r}, not one of {CUDA_HEADERS}")
        return (folder / header).read_text()

    return _INCLUDE.sub(paste, (folder / name).read_text())
