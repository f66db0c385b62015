r"""How a bucket's buffer is averaged at one bit: the exchange an optimizer is built on.

An *exchange* owns the shape of the compressed average (flat SPEC §1 over all ranks, or a
hierarchical variant) and names the per-rank persistent buffers it needs (the error-feedback
state). The optimizers never size or interpret those buffers themselves: they ask
``state_numels(L)`` once per bucket, keep the buffers (fp32, zero-initialised, saved per rank in
``state_dict()``), and hand them back on every call. So a new topology or error-feedback policy
is a new exchange, not a change to any optimizer.

:class:`FlatExchange` is SPEC §1 itself: ``worker_error`` (N elements) and ``server_error``
(N/n elements) with N = ``padded_size(L, n)``. With ``feedback="econtrol"`` the workers use
EControl error feedback (docs/algorithms/error_feedback.md), which adds ``worker_estimate`` and
``mean_estimate`` (N each) and a one-element ``started`` flag.

The package: :mod:`~commopt.exchange.flat` (SPEC §1), :mod:`~commopt.exchange.econtrol` (its
EControl workers), :mod:`~commopt.exchange.hierarchical` (full precision inside a node, 1 bit
between nodes; its level backends in :mod:`~commopt.exchange.levels`, the node layout in
:mod:`~commopt.exchange.topology`), and one factory, :func:`build_exchange`.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from commopt import choices
from commopt.comm import Backend, TorchBackend, resolve_backend
from commopt.exchange.flat import Exchange, FlatExchange
from commopt.exchange.hierarchical import HierarchicalExchange
from commopt.exchange.levels import wants_shared_memory
from commopt.exchange.topology import Topology, discover_topology

__all__ = [
    "Exchange",
    "FlatExchange",
    "HierarchicalExchange",
    "Topology",
    "build_exchange",
    "discover_topology",
]


def build_exchange(
    backend: Backend | None = None,
    topology: choices.Topology = "flat",
    *,
    error_feedback: choices.ErrorFeedback = "classic",
    eta: float = 0.2,
    **kwargs: Any,
) -> Exchange:
    """The exchange for ``topology``: ``"flat"`` (SPEC §1), ``"hierarchical"`` or ``"auto"``,
    with ``error_feedback`` ``"classic"`` or ``"econtrol"`` (EControl's η: ``eta``; flat
    exchange only).

    ``"auto"`` is hierarchical when there is more than one node and more than one rank per node,
    and flat otherwise — also, with one warning, when nodes have unequal numbers of ranks (the
    hierarchical exchange needs equal nodes; flat is correct for any layout), and when the local
    level would be gloo over TCP loopback on some node (a gloo backend without shared memory,
    ``COMMOPT_SHARED_MEMORY=0`` or no /dev/shm, and no ``local_backend`` given): measured on 2
    hosts × 2 ranks, that local level made the exchange 0.77–0.94× flat's speed at 1 Gbit/s,
    the shared-memory one 0.97–1.10× (docs/performance.md). ``"auto"`` and
    ``"hierarchical"`` discover the topology collectively, so every rank must call this.
    ``kwargs`` go to :class:`HierarchicalExchange` (``topology=`` there is spelled
    ``node_topology=`` here; ``local_backend``, ``cross_backend``, ``shared_memory``, ``env``,
    ``hostname``).
    """
    be = resolve_backend(backend)
    if topology == "flat":
        if kwargs:
            raise ValueError(f"topology='flat' takes no further arguments, got {sorted(kwargs)}")
        return FlatExchange(be, error_feedback, eta)
    exchange = _build_hierarchical(be, topology, **kwargs)
    if error_feedback != "classic":
        if not isinstance(exchange, FlatExchange):
            raise ValueError(
                f"error_feedback={error_feedback!r} is implemented for the flat exchange only, "
                f"and topology={topology!r} resolved to a hierarchical one; use "
                "topology='flat' or error_feedback='classic'"
            )
        exchange = FlatExchange(be, error_feedback, eta)
    return exchange


def _build_hierarchical(be: Backend, topology: str, **kwargs: Any) -> Exchange:
    choices.check_choice("topology", topology, choices.TOPOLOGIES)
    node_topology = kwargs.pop("node_topology", None)
    if node_topology is None:
        node_topology = discover_topology(be, kwargs.get("env"), hostname=kwargs.get("hostname"))
    if topology == "auto":
        if not node_topology.uniform:
            warnings.warn(
                "topology='auto': nodes have unequal numbers of ranks "
                f"{[len(r) for r in node_topology.nodes]}, so the flat exchange is used "
                "(the hierarchical one pairs local rank j of every node)",
                stacklevel=3,
            )
            return FlatExchange(be)
        if node_topology.num_nodes == 1 or node_topology.local_size == 1:
            return FlatExchange(be)
        if kwargs.get("local_backend") is None and isinstance(be, TorchBackend):
            shared = kwargs.get("shared_memory", "auto")
            slow = be.engine == "gloo" and not wants_shared_memory(be, shared)
            votes = torch.tensor([int(slow)], dtype=torch.int64)
            be.all_reduce(votes)  # every rank decides alike, whatever its node has
            if int(votes):
                return FlatExchange(be)
    return HierarchicalExchange(be, node_topology, **kwargs)
