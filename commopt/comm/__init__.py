"""Communication backends and the rule that resolves ``backend=None`` (SPEC §5)."""

from __future__ import annotations

from commopt.comm.asynchronous import all_gather_async, all_reduce_async, all_to_all_async
from commopt.comm.base import OPERATIONS, Backend, CommStats, SingleProcessBackend, model_bytes
from commopt.comm.default import get_default_backend, resolve_backend, set_default_backend
from commopt.comm.mixed import MixedBackend, available_backends
from commopt.comm.mpi_backend import MpiBackend
from commopt.comm.torch_backend import TorchBackend

__all__ = [
    "OPERATIONS",
    "Backend",
    "CommStats",
    "MixedBackend",
    "MpiBackend",
    "SingleProcessBackend",
    "TorchBackend",
    "all_gather_async",
    "all_reduce_async",
    "all_to_all_async",
    "available_backends",
    "get_default_backend",
    "model_bytes",
    "resolve_backend",
    "set_default_backend",
]
