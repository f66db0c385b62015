"""One optimizer's communication: its backend, its exchange, and a count of what went over them.

The backend is resolved at first use (``backend=None`` → SPEC §5), so an optimizer can be built
before the process group exists; the exchange (SPEC §1 over the backend, or the hierarchical
exchange of :mod:`commopt.exchange.hierarchical`, per ``topology``) is built from it at first use
too.
Every full-precision average and every compressed exchange is counted here, and
:meth:`Communication.stats` reports the counts with the backend's traffic
(``optimizer.comm_stats()``).
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from commopt.comm import Backend, resolve_backend
from commopt.exchange import Exchange, FlatExchange, build_exchange
from commopt.optim.flat_state import FlatState
from commopt.sharding import Sharding

if TYPE_CHECKING:
    from commopt.optim.config import CommOptions

__all__ = ["Communication"]


class Communication:
    """The backend an optimizer talks over, its exchange, and the rounds it took.

    Args:
        requested: the optimizer's ``backend`` argument (None: SPEC §5 at first use).
        options: the optimizer's topology, error feedback and EControl η
            (:func:`~commopt.exchange.build_exchange`).
    """

    def __init__(self, requested: Backend | None, options: CommOptions) -> None:
        if isinstance(requested, (str, bytes, os.PathLike)):
            resolve_backend(requested)  # raises the TypeError that says how to build one
        self.requested = requested
        self._options = options
        self._backend: Backend | None = None
        self._exchange: Exchange | None = None
        self._rounds = {"full": 0, "compressed": 0}
        #: sharded parameters (:mod:`commopt.sharding`): averages and exchanges run over the
        #: replicate group; None: every rank holds whole parameters
        self.sharding: Sharding | None = None
        #: (‖e‖², ‖c‖²) of this rank's last compressed call (see :meth:`stats`)
        self.last_compression: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> Communication:
        """A copy (``copy.deepcopy`` of an optimizer) that talks over the same backend and
        exchange (they hold no training state) and counts its own rounds."""
        new = copy.copy(self)
        memo[id(self)] = new
        new.__dict__.update(_rounds=dict(self._rounds), last_compression=None)
        return new

    @property
    def backend(self) -> Backend:
        """The resolved communication backend (``backend=None`` → SPEC §5, at first use)."""
        if self._backend is None:
            self._backend = resolve_backend(self.requested)
        return self._backend

    @property
    def exchange(self) -> Exchange:
        """How buckets are averaged at one bit: SPEC §1 over :attr:`backend`, or the
        hierarchical exchange of :mod:`commopt.exchange.hierarchical` (``topology``)."""
        if self._exchange is None and self.sharding is not None:
            opts = self._options
            self._exchange = FlatExchange(  # SPEC §1 between the replicas of this rank's shard
                self.sharding.replicate,
                opts.error_feedback,
                opts.econtrol_eta,
                layout=self.sharding.name,
            )
        if self._exchange is None:
            # one rank has no nodes to tell apart: flat (builds no process groups)
            opts = self._options
            topology = opts.topology if self.backend.world_size > 1 else "flat"
            self._exchange = build_exchange(
                self.backend, topology, error_feedback=opts.error_feedback, eta=opts.econtrol_eta
            )
        return self._exchange

    def shard_over(self, sharding: Sharding) -> None:
        """Average and exchange over ``sharding.replicate`` from now on (the optimizer has not
        stepped: an exchange built already holds no state, and is built anew)."""
        self.sharding = sharding
        self._exchange = None

    @property
    def averaging_backend(self) -> Backend:
        """Where gradients are averaged: every rank, or the replicas of this rank's shard."""
        return self.backend if self.sharding is None else self.sharding.replicate

    def average(self, flat: torch.Tensor) -> torch.Tensor:
        """Full-precision average across ranks (warmup and variance steps); over the replicate
        group when sharded (the shard group averaged the gradient in its reduce-scatter)."""
        be = self.averaging_backend
        if be.world_size > 1:
            be.all_reduce(flat, "avg")
            self._rounds["full"] += 1
        return flat

    def count_average(self) -> None:
        """Count a full-precision average run elsewhere (asynchronously, by the early work)."""
        self._rounds["full"] += 1

    @property
    def full_rounds(self) -> int:
        """Full-precision averages taken so far."""
        return self._rounds["full"]

    @property
    def compressed_rounds(self) -> int:
        """Compressed exchanges taken so far."""
        return self._rounds["compressed"]

    def compress(
        self, flat: torch.Tensor, comm: dict[str, torch.Tensor], track_error: bool
    ) -> torch.Tensor:
        """Error-compensated 1-bit average of ``flat`` across ranks, written back into it, with
        the exchange state ``comm`` (a bucket's, or staged copies of it).

        At n = 1 the exchange is the identity but still refuses non-finite values, so a step
        behaves alike at every world size (``NonFiniteError``: skipped, nothing changed).
        ``track_error``: keep what :meth:`stats` needs for ``compression_error``.
        """
        s = self.exchange.allreduce_(flat, comm)
        if self.exchange.backend.world_size > 1:
            e = comm.get("worker_error")
            if track_error and s is not None and e is not None:
                # e is now c − s·sgn(c); ‖c‖² = N·s² by the definition of s (s = ‖c‖/√N).
                # e·e in fp32 costs one pass; it overflows for |e| near 1e18, and then stats()
                # recomputes it in fp64 from e, if nothing has written e since.
                self.last_compression = (
                    e.dot(e),
                    s.double().square() * e.numel(),
                    e,
                    e._version,
                )
            self._rounds["compressed"] += 1
        return flat

    def stats(self, skipped_steps: int, states: Sequence[FlatState]) -> dict[str, Any]:
        """Traffic of the backend plus full-precision vs compressed rounds.

        ``compression_error`` is ‖e‖/‖c‖ for this rank's last compressed call: c = x + e_old is
        the error-compensated buffer this rank compressed and e = c − s·sgn(c) what its 1-bit
        approximation missed (worker side only). It lies in [0, √2): about 0.6 for
        Gaussian-like values, lower when magnitudes are uniform; a steady rise means the error
        feedback is no longer keeping up. ``None`` before the first compressed call.
        ``exchange_state_numel`` counts this rank's exchange buffers over ``states``.
        """
        stats = self.backend.stats
        if self.sharding is not None:  # the replicate and shard groups count their own
            stats = stats + self.sharding.replicate.stats + self.sharding.shard.stats
        error = None
        if self.last_compression is not None:
            dot, c_sq_t, e, version = self.last_compression
            e_sq, c_sq = float(dot), float(c_sq_t)
            if not math.isfinite(e_sq) and e._version == version:
                e_sq = float(torch.linalg.vector_norm(e, dtype=torch.float64)) ** 2
            if math.isfinite(e_sq) and math.isfinite(c_sq):
                error = (max(e_sq, 0.0) / c_sq) ** 0.5 if c_sq > 0 else 0.0
        return {
            "calls": stats.calls,
            "bytes_sent": stats.bytes_sent,
            # modelled per collective (comm/base.py); these collectives are symmetric under it
            "bytes_received": stats.bytes_sent,
            "calls_by_op": dict(stats.calls_by_op),
            "bytes_by_op": dict(stats.bytes_by_op),
            "full_precision_rounds": self._rounds["full"],
            "compressed_rounds": self._rounds["compressed"],
            "skipped_steps": skipped_steps,
            "compression_error": error,
            "exchange_state_numel": sum(b.numel() for s in states for b in s.comm.values()),
        }
