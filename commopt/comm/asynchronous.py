"""Collectives that start now and finish later, on the backends that can do so.

The :class:`~commopt.comm.Backend` contract is synchronous, and stays so: every backend
implements it. A backend *may* also offer non-blocking variants that return a
``torch.futures.Future`` completing with the output tensor:

- ``all_reduce_async(t, op)``, ``all_gather_async(out, t)``, ``all_to_all_async(out, t)``.

:class:`~commopt.comm.TorchBackend` implements them with ``async_op=True`` (gloo runs the
collective on its own worker threads); :class:`~commopt.comm.MpiBackend` with
``Iallreduce``/``Iallgather``/``Ialltoall``, completed by a progress thread (see
:mod:`commopt.comm.mpi_backend`). The functions below use them when present and otherwise run
the synchronous call and return a completed future (MixedBackend, SharedMemoryBackend,
SingleProcessBackend): the same result, bit for bit, only without overlap. Callers (the DDP
hook, the optimizers' overlap, the pipelined compressed allreduce) therefore need one code path.

Rules for callers: start collectives in the same order on every rank; do not read or write a
collective's tensors until its future has completed, and on a GPU order the reading stream
after it with ``wait()`` (:mod:`commopt.comm.handoff`); a future's ``wait()`` re-raises what
the collective raised.

Who holds the GIL, so that a communication thread lets the main thread's backward run
(measured by ``tests/unit/test_kernels_nogil.py``, ``tests/multirank/test_async_gloo.py`` and
``tests/multirank/mpi/test_async_mpi.py``):

- The numba kernels of the compressed allreduce (``scale``, ``pack_compensated_``,
  ``server_reduce_``, ``unpack_scaled_`` and the rest of :mod:`commopt.kernels.numba_kernels`)
  are compiled with ``nogil=True``: the GIL is released for the whole per-element loop. The
  Python glue around them (argument checks, creating tensors, ``_rms``) holds it for
  microseconds per call.
- torch.distributed releases the GIL inside blocking collectives and inside ``Work.wait()`` /
  ``Future.wait()`` (gloo does the transfer on its own threads): a thread blocked in
  ``dist.all_reduce`` does not stop other Python threads.
- mpi4py releases the GIL around every MPI call, blocking ones and ``Request.Wait`` included.
  Open MPI's blocking calls and ``Wait`` busy-poll, though: the waiting thread keeps a core
  busy (unless Open MPI runs with ``mpi_yield_when_idle``), which on a machine with fewer cores
  than ranks and threads takes CPU from backward even though the GIL is free.
- The reference :class:`~commopt.kernels.TorchKernels` run torch operators, which release the
  GIL inside each operator but take it back between operators (many short holds).
"""

from __future__ import annotations

import torch

from commopt.comm.base import Backend, ReduceOp
from commopt.comm.handoff import completed_future

__all__ = ["all_gather_async", "all_reduce_async", "all_to_all_async"]


def _start(backend: Backend, op: str, *args: object) -> torch.futures.Future[torch.Tensor]:
    """``backend.<op>_async(*args)`` when the backend has it, else the blocking ``op``."""
    start = getattr(backend, f"{op}_async", None)
    if start is not None:
        return start(*args)
    return completed_future(getattr(backend, op)(*args))


def all_reduce_async(
    backend: Backend, t: torch.Tensor, op: ReduceOp = "sum"
) -> torch.futures.Future[torch.Tensor]:
    """Start ``backend.all_reduce(t, op)``; the future's value is ``t``, reduced in place.

    ``t`` must not be read or written until the future has completed.
    """
    return _start(backend, "all_reduce", t, op)


def all_gather_async(
    backend: Backend, out: torch.Tensor, t: torch.Tensor
) -> torch.futures.Future[torch.Tensor]:
    """Start ``backend.all_gather(out, t)``; the future's value is ``out``.

    Neither tensor may be touched until the future has completed.
    """
    return _start(backend, "all_gather", out, t)


def all_to_all_async(
    backend: Backend, out: torch.Tensor, t: torch.Tensor
) -> torch.futures.Future[torch.Tensor]:
    """Start ``backend.all_to_all(out, t)``; the future's value is ``out``.

    Neither tensor may be touched until the future has completed.
    """
    return _start(backend, "all_to_all", out, t)
