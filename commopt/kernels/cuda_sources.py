"""Where the CUDA C kernels live: ``commopt/cuda/`` in a wheel, ``cuda/`` in a checkout.

Kept apart from :mod:`commopt.kernels.cupy_kernels` so that it imports without CuPy (the
packaging test and the nvcc compile test use it on machines with no GPU).
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

__all__ = ["CUDA_SOURCES", "cuda_source", "cuda_source_dir"]

#: The kernel sources, one per stage of SPEC §1.
CUDA_SOURCES = ("worker.cu", "server.cu", "unpack.cu")


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
    """The text of one kernel source, e.g. ``cuda_source("worker.cu")``.

    Raises:
        ValueError: ``name`` is not one of :data:`CUDA_SOURCES`.
    """
    if name not in CUDA_SOURCES:
        raise ValueError(f"unknown CUDA source {name!r}; expected one of {CUDA_SOURCES}")
    return (cuda_source_dir() / name).read_text()
