r"""MCR-DL-style mixing: each collective goes to whichever child backend is fastest for it.

No single communication library wins every operation at every message size (Anthony et al.,
"MCR-DL", IPDPS 2023). :class:`MixedBackend` holds several backends — typically a
:class:`~commopt.comm.TorchBackend` over gloo/NCCL and an :class:`~commopt.comm.MpiBackend` — and
routes each call by (operation, message size in bytes, dtype) through a selection table that
``commopt tune`` measures and writes (schema: :mod:`commopt.comm.table`,
``docs/mixed-backend.md``).

Three rules make mixing safe, i.e. free of cross-library deadlocks and of divergent ranks:

1. **One table everywhere.** At construction rank 0's table is broadcast (over the first child
   backend) and every rank uses it; a rank that loaded a different one logs a warning and is
   corrected. A table rank 0 cannot load or that fails validation raises the same ``ValueError``
   on every rank, before any routed call.
2. **Selection is a pure function of (op, size, dtype)**, all of which are equal on every rank
   for a collective, so every rank sends the k-th collective to the same backend.
3. **Drain before switching.** Before a call runs on a backend other than the previous call's,
   everything the previous backend started is complete. Our backends are synchronous: on CPU a
   call returns only when its data has arrived, so there is nothing left to drain. On CUDA,
   NCCL returns once the work is *queued* on the current stream; a following MPI call that reads
   device memory directly (``cuda_aware=True``) would not wait for it, so the current CUDA stream
   is synchronized before switching away from a call that touched CUDA tensors. A child with a
   ``synchronize()`` method (an asynchronous backend) has it called too.

With every rank issuing the same sequence of collectives to the same backends and no backend
holding work in flight when another starts, each library only ever waits for its own peers.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from commopt.comm.base import Backend, CommStats, ReduceOp
from commopt.comm.table import SelectionTable, canonical_json, load_table

__all__ = ["MixedBackend", "available_backends"]

logger = logging.getLogger(__name__)

_OK, _FAILED = 1, 0


def available_backends() -> dict[str, Backend]:
    """The backends this process can use now, by name: ``"torch"`` when torch.distributed is
    initialized (call :func:`commopt.init` first), ``"mpi"`` when an MPI launcher started the
    process and mpi4py imports.
    """
    import torch.distributed as dist

    from commopt.comm.default import get_default_backend
    from commopt.comm.env import launched_by_mpi
    from commopt.comm.mpi_backend import MpiBackend
    from commopt.comm.torch_backend import TorchBackend

    found: dict[str, Backend] = {}
    default = get_default_backend()
    if dist.is_available() and dist.is_initialized():
        found["torch"] = default if isinstance(default, TorchBackend) else TorchBackend()
    if launched_by_mpi():
        try:
            found["mpi"] = default if isinstance(default, MpiBackend) else MpiBackend()
        except ImportError:
            logger.info("launched by MPI but mpi4py is missing: no 'mpi' backend")
    return found


def _by_name(backends: Mapping[str, Backend] | Sequence[Backend]) -> dict[str, Backend]:
    if isinstance(backends, Mapping):
        named = dict(backends)
    elif isinstance(backends, Sequence) and not isinstance(backends, (str, bytes)):
        named = {}
        for b in backends:
            name = getattr(b, "name", None)
            if not isinstance(name, str):
                raise TypeError(f"backends: {b!r} has no string 'name'; pass a dict name → backend")
            if name in named:
                raise ValueError(
                    f"backends: two backends are named {name!r}; pass a dict to name them apart"
                )
            named[name] = b
    else:
        raise TypeError(
            f"backends must be a dict name → Backend or a list of backends, got "
            f"{type(backends).__name__}"
        )
    if not named:
        raise ValueError("backends: MixedBackend needs at least one child backend, got none")
    for name, b in named.items():
        if not isinstance(name, str):
            raise TypeError(f"backends: names must be strings, got {name!r}")
        if not isinstance(b, Backend):
            raise TypeError(
                f"backends[{name!r}] = {b!r} does not implement the Backend protocol (name, rank, "
                "world_size, stats, all_reduce, all_gather, all_to_all, broadcast, barrier)"
            )
        if isinstance(b, MixedBackend):
            raise TypeError(f"backends[{name!r}] is itself a MixedBackend; pass its children")
    return named


class MixedBackend:
    r"""Routes each collective to one of several backends by (operation, size, dtype).

    The message size is the byte size of the tensor the call is given: ``t`` for
    ``all_reduce``, ``all_gather`` (this rank's contribution), ``all_to_all`` (the whole input)
    and ``broadcast``; 0 for ``barrier``.

    Args:
        backends: the children, as a dict name → backend (the names the table uses) or a list
            (named by their ``name`` attribute, e.g. ``"torch"``, ``"mpi"``). Every rank passes
            the same names in the same order; all must span the same ranks in the same order.
        table: the selection table as a dict or a path to its JSON file. Only rank 0's copy is
            used (see the module docstring).

    Attributes:
        stats: every routed call, counted once (the children count their own calls as well).
        calls_by_backend: routed calls per child name.
        switches: how many calls went to a different backend than the call before.
        corrected: True when this rank's own table differed from rank 0's and was replaced.

    Raises:
        ValueError: on every rank alike — rank 0's table is unreadable or malformed, has gaps or
            overlaps in a size range, or names a backend not in ``backends``; or (locally) the
            children disagree on rank or world size.
        TypeError: a child does not implement the Backend protocol.

    Examples:
        >>> import commopt
        >>> from commopt.comm import MixedBackend, MpiBackend, TorchBackend
        >>> commopt.init()                                               # doctest: +SKIP
        >>> be = MixedBackend([TorchBackend(), MpiBackend()], "table.json")  # doctest: +SKIP
        >>> opt = commopt.OnebitAdam(model.parameters(), backend=be)      # doctest: +SKIP
    """

    name = "mixed"

    def __init__(
        self,
        backends: Mapping[str, Backend] | Sequence[Backend],
        table: Mapping[str, Any] | str | os.PathLike[str],
    ) -> None:
        self.backends = _by_name(backends)
        first = next(iter(self.backends.values()))
        self.rank, self.world_size = first.rank, first.world_size
        for name, b in self.backends.items():
            if (b.rank, b.world_size) != (self.rank, self.world_size):
                raise ValueError(
                    f"backends disagree on this process: {name!r} says rank {b.rank} of "
                    f"{b.world_size}, {next(iter(self.backends))!r} rank {self.rank} of "
                    f"{self.world_size}; children must span the same processes in the same order"
                )
        self.stats = CommStats()
        self.calls_by_backend: dict[str, int] = dict.fromkeys(self.backends, 0)
        self.switches = 0
        self._last: str | None = None
        self._last_cuda: torch.device | None = None

        agreed, self.corrected = self._agree_on_table(first, table)
        self.selection = SelectionTable(agreed, available=self.backends)
        self.table: dict[str, Any] = agreed
        tuned_n = agreed.get("world_size")
        if isinstance(tuned_n, int) and tuned_n != self.world_size:
            logger.warning(
                "selection table was tuned at world size %d, running at %d: routing is valid "
                "but may not be the fastest; re-run `commopt tune` at this size",
                tuned_n,
                self.world_size,
            )

    @classmethod
    def from_table(cls, table: Mapping[str, Any] | str | os.PathLike[str]) -> MixedBackend:
        """A MixedBackend over :func:`available_backends` with ``table`` (a path or a dict).

        Collective (rank 0's table is broadcast): every rank calls it, after
        :func:`commopt.init`. ``commopt tune -o table.json`` writes such a table.
        """
        found = available_backends()
        if not found:
            raise RuntimeError(
                "no communication backend is available: call commopt.init() under torchrun or "
                "mpirun before building a MixedBackend"
            )
        return cls(found, table)

    from_available = from_table  # the name before 0.2; kept so old code keeps working

    # -- the table ------------------------------------------------------------------------------
    def _agree_on_table(
        self, via: Backend, table: Mapping[str, Any] | str | os.PathLike[str]
    ) -> tuple[dict[str, Any], bool]:
        """Everyone adopts rank 0's table; a rank whose own copy differs is told so."""
        try:
            local: str | None = canonical_json(load_table(table))
            problem = ""
        except Exception as err:  # whatever it is, every rank must hear of it (or none waits)
            local = None
            problem = str(err) if isinstance(err, (ValueError, TypeError)) else repr(err)
        if self.world_size == 1:
            if local is None:
                raise ValueError(problem)
            return _parse(local), False

        payload = (local if local is not None else problem).encode()
        header = torch.tensor(
            [_OK if local is not None else _FAILED, len(payload)], dtype=torch.int64
        )
        via.broadcast(header, 0)
        status, length = int(header[0]), int(header[1])
        buf = torch.zeros(length, dtype=torch.uint8)
        if self.rank == 0 and length:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        if length:
            via.broadcast(buf, 0)
        text = buf.numpy().tobytes().decode()
        if status != _OK:
            raise ValueError(f"rank 0 could not load the selection table: {text}")
        corrected = self.rank != 0 and local != text
        if corrected:
            logger.warning(
                "rank %d: its selection table %s rank 0's; using rank 0's table (the table "
                "must be identical on every rank)",
                self.rank,
                "could not be loaded and was replaced by" if local is None else "differs from",
            )
        return _parse(text), corrected

    def select(self, op: str, nbytes: int, dtype: torch.dtype | str | None = None) -> str:
        """The child name the table picks for ``op`` on ``nbytes`` bytes of ``dtype``."""
        return self.selection.select(op, nbytes, dtype)

    # -- channels (commopt.comm.channels) ------------------------------------------------------
    def open_channel(self, name: str) -> bool:
        """Open channel ``name`` on every backend it routes to, in the table's order
        (collective); False, with none left open, when one of them cannot open one."""
        opened = []
        for backend in self.backends.values():
            opener = getattr(backend, "open_channel", None)
            if opener is None or not opener(name):
                _close_channel(opened, name)
                return False
            opened.append(backend)
        return True

    def close_channel(self, name: str) -> None:
        """Close channel ``name`` on every backend it routes to."""
        _close_channel(self.backends.values(), name)

    # -- routing ----------------------------------------------------------------------------------
    def _route(self, op: str, nbytes: int, t: torch.Tensor | None) -> Backend:
        name = self.selection.select(op, nbytes, None if t is None else t.dtype)
        if name != self._last:
            if self._last is not None:
                self._drain(self._last)
                self.switches += 1
            self._last = name
        self.calls_by_backend[name] += 1
        self.stats.record(op, nbytes, self.world_size)
        self._last_cuda = t.device if t is not None and t.device.type == "cuda" else None
        return self.backends[name]

    def _drain(self, name: str) -> None:
        """Make sure nothing the backend ``name`` started is still pending."""
        sync = getattr(self.backends[name], "synchronize", None)
        if callable(sync):
            sync()
        if self._last_cuda is not None:
            torch.cuda.current_stream(self._last_cuda).synchronize()

    def all_reduce(self, t: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """:meth:`Backend.all_reduce` on the backend the table picks for this size."""
        return self._route("all_reduce", t.numel() * t.element_size(), t).all_reduce(t, op)

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """:meth:`Backend.all_gather` on the backend the table picks for this size."""
        return self._route("all_gather", t.numel() * t.element_size(), t).all_gather(out, t)

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """:meth:`Backend.all_to_all` on the backend the table picks for this size."""
        return self._route("all_to_all", t.numel() * t.element_size(), t).all_to_all(out, t)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """:meth:`Backend.broadcast` on the backend the table picks for this size."""
        return self._route("broadcast", t.numel() * t.element_size(), t).broadcast(t, src)

    def barrier(self) -> None:
        """A barrier on the backend the table picks for it."""
        self._route("barrier", 0, None).barrier()

    def __repr__(self) -> str:
        kids = ", ".join(f"{k}={v!r}" for k, v in self.backends.items())
        return f"MixedBackend({kids}, rank={self.rank}, world_size={self.world_size})"


def _parse(text: str) -> dict[str, Any]:
    return json.loads(text)


def _close_channel(backends: Iterable[Backend], name: str) -> None:
    """Close channel ``name`` on each of ``backends`` that can close one."""
    for backend in backends:
        closer = getattr(backend, "close_channel", None)
        if closer is not None:
            closer(name)
