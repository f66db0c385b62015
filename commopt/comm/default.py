"""The rule that resolves ``backend=None`` (SPEC §5), and the default it starts from."""

from __future__ import annotations

import os

import torch.distributed as dist

from commopt.comm.base import Backend, SingleProcessBackend
from commopt.comm.env import int_env, launched_by_mpi
from commopt.comm.mpi_backend import MpiBackend
from commopt.comm.torch_backend import TorchBackend

__all__ = ["get_default_backend", "resolve_backend", "set_default_backend"]

_default: Backend | None = None
_implicit: Backend | None = None  # built by resolve_backend when nothing was set explicitly


def set_default_backend(backend: Backend | None) -> None:
    """Make ``backend`` what ``backend=None`` means from now on (``None`` clears it)."""
    global _default, _implicit
    _default = backend
    _implicit = None


def get_default_backend() -> Backend | None:
    """The backend set by :func:`commopt.init` or :func:`set_default_backend`, if any."""
    return _default


def resolve_backend(backend: Backend | None = None) -> Backend:
    """Resolve ``backend=None``, in order: the backend set by ``commopt.init()``;
    torch.distributed's default group if it is initialized; MPI ``COMM_WORLD`` when launched by
    an MPI launcher; otherwise a world of one process. A backend object is returned as it is.

    Raises:
        RuntimeError: ``WORLD_SIZE`` > 1 (torchrun's variable) but no process group exists and
            no MPI launcher started this process: commopt would train this rank alone (an
            addition to SPEC §5, whose last rule is a world of one).
        TypeError: ``backend`` is a string or path. A selection table does not make a backend
            by itself (building one is collective); build it explicitly with
            ``MixedBackend.from_table(path)`` on every rank and pass that.
    """
    global _implicit
    if isinstance(backend, (str, bytes, os.PathLike)):
        raise TypeError(
            f"backend={backend!r}: a path is not a backend. Build the mixed backend explicitly "
            "(on every rank, after commopt.init()): "
            "backend=commopt.MixedBackend.from_table(path)"
        )
    if backend is not None:
        return backend
    if _default is not None:
        return _default
    if dist.is_available() and dist.is_initialized():
        # Re-use the cached wrapper (and its counters) while it still describes the live group.
        if not (
            isinstance(_implicit, TorchBackend)
            and _implicit.world_size == dist.get_world_size()
            and _implicit.rank == dist.get_rank()
        ):
            _implicit = TorchBackend()
        return _implicit
    if launched_by_mpi():
        if not isinstance(_implicit, MpiBackend):
            _implicit = MpiBackend()
        return _implicit
    _refuse_a_lone_rank()
    return SingleProcessBackend()


def _refuse_a_lone_rank() -> None:
    """A launcher started several ranks but none can reach the others: training on alone would
    give every rank its own model, with exit code 0. Each rank finds this out by itself, so all
    of them raise, and none waits for the others."""
    # int() as the launch discovery reads it: " 2", "+2" and "02" are 2, not a world of one
    size = int_env(os.environ, "WORLD_SIZE") if "WORLD_SIZE" in os.environ else 1
    if size > 1:
        raise RuntimeError(
            f"WORLD_SIZE={size} says this is one of {size} ranks, but torch.distributed is not "
            "initialized, so commopt would train this rank alone: call commopt.init() (or "
            "torch.distributed.init_process_group()) on every rank before the first step, or "
            "pass backend= explicitly"
        )
