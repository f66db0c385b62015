r"""The hierarchical 1-bit allreduce: full precision inside a node, SPEC §1 between nodes.

With K nodes of L ranks each (n = K·L), a buffer of ``numel`` elements, N = ``padded_size(numel,
n)`` and S = N/L (the *slice*):

1. inside each node, a full-precision reduce-scatter: local rank j ends with z_j, the node's
   mean of slice j (elements j·S … (j+1)·S − 1);
2. across nodes, local rank j runs SPEC §1 on z_j with local rank j of every other node (a cross
   group of K ranks), with its own worker error (S elements) and server error (S/K): every NIC of
   a node carries 1/L of the node's bits and no two ranks send the same bytes;
3. inside each node, an all-gather of the 1-bit *result* of step 2 (S/8 bytes of signs and K fp32
   scales per rank, not S fp32) and every rank unpacks all L slices itself.

Bytes that cross the network per node drop by L against the flat exchange, and so does the
worker error. docs/hierarchical.md states the algorithm in full (padding, scales, bytes per
level). :func:`commopt.exchange.build_exchange` picks flat or hierarchical by name or by the
topology.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from commopt.comm import Backend, resolve_backend
from commopt.comm.shm_backend import SharedMemoryBackend
from commopt.compressed import NonFiniteError, overflow_safe, padded_size
from commopt.exchange.flat import FlatExchange
from commopt.exchange.levels import (
    SharedMemory,
    build_level_backends,
    check_level_backends,
    wants_shared_memory,
)
from commopt.exchange.topology import Topology, discover_topology
from commopt.kernels import Kernels, get_kernels
from commopt.pipelined import auto_stages, check_stages, staged_server

__all__ = ["HierarchicalExchange"]


class HierarchicalExchange:
    r"""The 1-bit average of SPEC §1, done per level: exact inside a node, 1-bit across nodes.

    With K nodes × L ranks, N = ``padded_size(numel, K·L)``, S = N/L, for local rank j on node i:

    0. Inside the node, one tiny all-gather of every rank's (finite?, numel).
    1. x̄ = pad(x) to N; local reduce-scatter of x̄ viewed as [L, S] (row j to local rank j):
       z = (Σ_l row from local rank l, summed in local-rank order) / L — the node mean of slice j,
       fp32. (A node whose records already show a problem skips this.)
    2. (y_j, s) = SPEC §1 on z over the cross group (local rank j of every node; cross rank = i),
       with worker error e (S elements) and server error f (S/K). S is a multiple of 8·K, so the
       cross level pads nothing and each of its K server chunks is S/(8K) whole bytes. First
       a tiny all-gather inside the node of every local rank's safe? (:meth:`_node_safe`).
       Then three collectives: the all-gather of the worker scales also carries every node's
       records and safe? flags, so every rank checks all n ranks there, before any state
       changes, and raises alike; the sign all-to-all; one byte all-gather of (server signs,
       server scale).
    3. y_j is t_k·sgn over K chunks: those K chunks of signs (S/8 bytes, MSB first) and the K
       scales t_k, as the cross level's last all-gather delivered them, are all-gathered inside
       the node, and every rank unpacks all L·K chunks into the output: y = concat_j y_j, first
       numel elements. Seven collectives per call, three of them across nodes (flat: four).

    In P > 1 stages (``pipeline``), steps 2–3 run as :mod:`commopt.pipelined` runs flat's: range
    k of every cross server chunk is stage k, the K server scales travel apart, and each stage's
    signs are gathered inside the node and unpacked while the later ones cross. The same bits
    and bytes, in 2P + 2 cross and P + 4 local collectives.

    Every rank of a node unpacks the same bytes, and step 2 is bit-identical across each cross
    group, so the output is bit-identical on all n ranks. With one node (K = 1) or one rank per
    node (L = 1) it is exactly :class:`~commopt.exchange.FlatExchange` on the global backend
    (same state names and sizes, same bits).

    State per rank: ``worker_error`` S = N/L elements (flat: N) and ``server_error`` S/K = N/n
    (flat: the same N/n). The worker error shrinks by L.

    ``name`` (what checkpoints record) is ``"hierarchical:KxL:i.j"`` — K nodes × L ranks, this
    rank on node i as local rank j — since the meaning of a rank's buffers depends on all four;
    ``"flat"`` when there is only one level (the state is the flat exchange's).

    Args:
        backend: the global backend (all n ranks); ``exchange.backend`` is this.
        topology: which ranks share a node; discovered with :func:`~commopt.exchange.topology.
            discover_topology` (collective) when ``None``.
        local_backend: the L ranks of this node, ranked by local rank; built from ``backend``
            when ``None`` (torch: ``dist.new_group`` per node; MPI: ``comm.Split``). Give it the
            fastest path you have (shared memory, NVLink).
        cross_backend: local rank j of every node, ranked by node index; built likewise.
        shared_memory: when the local level is built from a TorchBackend, move it through one
            ``/dev/shm`` segment per node instead of the node's process group
            (:class:`~commopt.comm.shm_backend.SharedMemoryBackend`; 2·L·4N bytes of /dev/shm per
            node for an N-element buffer). ``"auto"`` (default): for gloo on a host with a
            writable /dev/shm, unless ``COMMOPT_SHARED_MEMORY=0``; a message too big for
            /dev/shm then goes through the process group (one warning). ``True``: always, and a
            too small /dev/shm is a ``RuntimeError``. ``False``: never.
        pipeline: the stages P of steps 2–3; ``None`` (default): :func:`~commopt.pipelined.
            auto_stages` of N over n ranks, as flat (4 at 16M elements).
        env, hostname: passed to :func:`~commopt.exchange.topology.discover_topology`.

    Raises:
        ValueError: nodes of unequal sizes, a topology that does not describe ``backend``, or
            level backends of the wrong size or membership (raised on every rank alike).
        TypeError: a global backend that cannot be split (pass both level backends instead).
    """

    name = "hierarchical"

    def __init__(
        self,
        backend: Backend | None = None,
        topology: Topology | None = None,
        *,
        local_backend: Backend | None = None,
        cross_backend: Backend | None = None,
        shared_memory: SharedMemory = "auto",
        pipeline: int | None = None,
        env: Mapping[str, str] | None = None,
        hostname: str | None = None,
    ) -> None:
        self.pipeline = check_stages(pipeline)
        self.backend = resolve_backend(backend)
        be = self.backend
        topo = discover_topology(be, env, hostname=hostname) if topology is None else topology
        if not isinstance(topo, Topology):
            raise TypeError(
                f"topology must be a commopt.exchange.topology.Topology, got {topo!r:.80}"
            )
        if topo.world_size != be.world_size or topo.rank != be.rank:
            raise ValueError(
                f"the topology describes rank {topo.rank} of {topo.world_size} but the backend is "
                f"rank {be.rank} of {be.world_size}: discover it on the same backend"
            )
        if not topo.uniform:
            raise ValueError(
                "HierarchicalExchange needs the same number of ranks on every node, got node "
                f"sizes {[len(r) for r in topo.nodes]}: use the flat exchange (topology='flat', "
                "or 'auto', which falls back to it) or launch equal ranks per node"
            )
        self.topology = topo
        self.local_size, self.num_nodes = topo.local_size, topo.num_nodes
        self._flat: FlatExchange | None = None
        self.local_backend: Backend | None = None
        self.cross_backend: Backend | None = None
        if self.local_size == 1 or self.num_nodes == 1:
            # Nothing to split: one level is empty, and the flat exchange is the exact answer.
            if local_backend is not None or cross_backend is not None:
                raise ValueError(
                    f"{topo.num_nodes} node(s) × {topo.local_size} rank(s): there is only one "
                    "level, so local_backend/cross_backend must not be given"
                )
            self._flat = FlatExchange(be, pipeline=pipeline)
            self.name = self._flat.name  # the same state, restorable both ways
            return
        # Checkpoints restore a rank's buffers only into an exchange of the same name (and world
        # size and rank): the name carries the layout, which a same-sized job can change.
        self.name = f"hierarchical:{topo.num_nodes}x{topo.local_size}:{topo.node}.{topo.local_rank}"
        if (local_backend is None) != (cross_backend is None):
            raise ValueError("pass both local_backend and cross_backend, or neither")
        if local_backend is None or cross_backend is None:
            shm = wants_shared_memory(be, shared_memory)
            local_backend, cross_backend = build_level_backends(be, topo, shm)
            if shm and isinstance(local_backend, SharedMemoryBackend):
                local_backend.fallback = shared_memory == "auto"
        self.local_backend, self.cross_backend = local_backend, cross_backend
        check_level_backends(be, topo, local_backend, cross_backend)
        # Wall seconds of each level in the last call (a diagnostic; ranks differ).
        self.phase_seconds: dict[str, float] = {}
        self._scratch: dict[int, dict[str, Any]] = {}

    # -- the Exchange protocol -----------------------------------------------------------------
    def state_numels(self, numel: int) -> dict[str, int]:
        """Per-rank buffers: the cross level's worker error and this rank's server share."""
        if self._flat is not None:
            return self._flat.state_numels(numel)
        slice_numel = padded_size(numel, self.backend.world_size) // self.local_size
        return {"worker_error": slice_numel, "server_error": slice_numel // self.num_nodes}

    def allreduce_(
        self, tensor: torch.Tensor, state: dict[str, torch.Tensor]
    ) -> torch.Tensor | None:
        """Replace ``tensor`` (1-D fp32) by its hierarchical 1-bit average over all ranks.

        Returns the worker scale s of this rank's slice (‖c‖² = S·s² for its S elements), or
        ``None`` when nothing was compressed.
        """
        if self._flat is not None:
            return self._flat.allreduce_(tensor, state)
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32:
            raise TypeError(f"allreduce_ needs a float32 tensor, got {tensor!r:.80}")
        if tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError(
                f"allreduce_ needs a contiguous 1-D tensor, got shape {tuple(tensor.shape)}"
            )
        local, cross = self.local_backend, self.cross_backend
        if local is None or cross is None:  # pragma: no cover - set whenever _flat is None
            raise RuntimeError("HierarchicalExchange has no level backends")
        L, K = self.local_size, self.num_nodes
        numel = tensor.numel()
        padded = padded_size(numel, self.backend.world_size)
        S = padded // L
        M8 = S // (8 * K)  # bytes of one cross server chunk
        e, f = state["worker_error"], state["server_error"]
        for key, buf, want in (("worker_error", e, S), ("server_error", f, S // K)):
            if buf.dtype != torch.float32 or buf.numel() != want or buf.device != tensor.device:
                raise ValueError(
                    f"{key} must be {want} fp32 elements on {tensor.device} "
                    f"(state_numels({numel})), got {buf.numel()} {buf.dtype} on {buf.device}"
                )
        kernels = get_kernels(tensor.device)
        stages = self.pipeline or auto_stages(padded, self.backend.world_size)
        buf = self._buffers(numel, padded, tensor.device, stages)

        # 0. inside the node, every local rank's (finite?, numel); 1. the local reduce-scatter
        #    (skipped by the whole node when its records already doom the call).
        t0 = time.perf_counter()
        node = self._node_records(tensor)
        s, z = torch.zeros(1, dtype=torch.float32), buf["z"]
        if numel and all(ok and length == numel for ok, length in node):
            reduce_scatter = getattr(local, "reduce_scatter_mean_", None)
            if reduce_scatter is not None:  # shared memory: sums straight out of the segment
                reduce_scatter(z, tensor)
            else:
                send = buf["send"]
                if send is None:
                    send = tensor
                else:
                    send[:numel].copy_(tensor)
                recv = buf["recv"]
                local.all_to_all(recv, send.view(L, S))
                torch.add(recv[0], recv[1], out=z)
                for i in range(2, L):
                    z.add_(recv[i])
                z.div_(L)
            s = kernels.scale(z, e)
        t1 = time.perf_counter()

        # 2. across nodes: SPEC §1 on the slice. First every rank of the node learns whether
        #    every local rank's (s, f) is safe (one tiny local all-gather); the cross (s, L)
        #    all-gather then carries those flags and the node records to every node, so all n
        #    ranks raise alike before any state changes. The server signs and the server scale
        #    travel as one byte buffer.
        worker_scales = self._agree(s, node, self._node_safe(s, f))
        if numel == 0:
            return None
        if stages > 1:
            t2 = self._staged_cross(tensor, z, s, worker_scales, e, f, kernels, stages)
        else:  # one stage: the server scale rides with its signs, one local gather
            bits, recv_bits, server, got = buf["bits"], buf["recv_bits"], buf["server"], buf["got"]
            kernels.pack_compensated_(z, s, e, bits)
            cross.all_to_all(recv_bits, bits.view(K, M8))
            t = kernels.server_reduce_(recv_bits, worker_scales, f, server[:M8])
            server[M8:].copy_(t.reshape(1).view(torch.uint8))
            cross.all_gather(got, server)
            t2 = time.perf_counter()
            # 3. inside the node: the 1-bit result of every slice (K chunks of signs, then K
            #    scales), forwarded as received: exactly the signs of y = t·sgn (t = 0 only when
            #    c_s is all zeros, whose signs are all + by SPEC §1's sgn).
            row, gathered = buf["row"], buf["gathered"]
            row[: S // 8].view(K, M8).copy_(got[:, :M8])
            row[S // 8 :].copy_(got[:, M8:].reshape(-1))
            local.all_gather(gathered, row)
            all_bits = gathered[:, : S // 8].contiguous().view(L * K, M8)
            all_scales = gathered[:, S // 8 :].contiguous().view(torch.float32).view(L * K)
            kernels.unpack_scaled_(all_bits, all_scales, tensor)
        t3 = time.perf_counter()
        self.phase_seconds = {"local_reduce": t1 - t0, "cross": t2 - t1, "local_gather": t3 - t2}
        return s

    def _staged_cross(
        self,
        tensor: torch.Tensor,
        z: torch.Tensor,
        s: torch.Tensor,
        worker_scales: torch.Tensor,
        e: torch.Tensor,
        f: torch.Tensor,
        kernels: Kernels,
        stages: int,
    ) -> float:
        """Steps 2–3 in ``stages`` stages (the class docstring); returns when the last left."""
        local, cross = self.local_backend, self.cross_backend
        assert local is not None and cross is not None
        L, K = self.local_size, self.num_nodes
        S, numel = z.numel(), tensor.numel()
        chunk = S // K
        server_scales, arrivals = staged_server(cross, kernels, z, s, e, worker_scales, f, stages)
        scales = torch.empty(L * K, dtype=torch.float32, device=z.device)
        local.all_gather(scales, server_scales)  # row l: local rank l's cross group's K scales
        t2 = time.perf_counter()
        for lo, hi, signs, done, _sent in arrivals:
            done.wait()
            m8 = (hi - lo) // 8
            gathered = torch.empty(L, K * m8, dtype=torch.uint8, device=z.device)
            local.all_gather(gathered, signs.view(-1))
            for r, bits in enumerate(gathered.view(L * K, m8)):  # r = l·K + i: slice l, chunk i
                a = (r // K) * S + (r % K) * chunk + lo
                if a >= numel:
                    break
                kernels.unpack_scaled_(
                    bits.view(1, m8), scales[r : r + 1], tensor[a : min(a + hi - lo, numel)]
                )
        return t2

    # -- helpers -------------------------------------------------------------------------------
    def _node_records(self, tensor: torch.Tensor) -> list[tuple[bool, int]]:
        """(finite?, numel) of every rank of this node, in local-rank order (one tiny
        all-gather inside the node); finite? = the fp32 sum of the input is finite."""
        numel = tensor.numel()
        finite = bool(torch.isfinite(tensor.sum())) if numel else True
        mine = torch.tensor([int(finite), numel], dtype=torch.int64)
        node = torch.empty(2 * self.local_size, dtype=torch.int64)
        assert self.local_backend is not None
        self.local_backend.all_gather(node, mine)
        return [(bool(ok), int(length)) for ok, length in node.view(-1, 2).tolist()]

    def _node_safe(self, s: torch.Tensor, f: torch.Tensor) -> list[bool]:
        """Every local rank's safe? = s ≤ 2^127/K and max|f| ≤ 2^127 (NaN fails), in one tiny
        all-gather inside the node: a scale overflowed from finite inputs (z or c = z + e) is
        seen by its cross group only and must reach the node's other groups before any e or f
        changes; the bounds keep a + f and every update finite (docs/hierarchical.md)."""
        safe = overflow_safe(s, f, self.num_nodes)
        flags = torch.empty(self.local_size, dtype=torch.int64)
        assert self.local_backend is not None
        self.local_backend.all_gather(flags, torch.tensor([int(safe)], dtype=torch.int64))
        return [bool(v) for v in flags.tolist()]

    def _agree(
        self, s: torch.Tensor, node: list[tuple[bool, int]], safe: list[bool]
    ) -> torch.Tensor:
        """The cross level's all-gather of (s, this node's records and safe? flags): every rank
        then knows every rank's (finite?, numel, safe?), raises alike before any state changes,
        and has the K worker scales of its cross group (returned, fp32).

        Unequal lengths → ``ValueError``; non-finite input → ``NonFiniteError(global ranks)``;
        else a scale or server error out of bounds (:meth:`_node_safe`: an overflow from finite
        inputs, in any cross group) → ``NonFiniteError`` naming those ranks; on every rank.
        """
        topo, cross = self.topology, self.cross_backend
        assert cross is not None
        K, L = topo.num_nodes, topo.local_size
        recs = [(ok, length, sf) for (ok, length), sf in zip(node, safe, strict=True)]
        values = [float(s[0]), *(float(v) for rec in recs for v in rec)]
        mine = torch.tensor(values, dtype=torch.float64)  # numel exact up to 2^53
        everyone = torch.empty(K * (1 + 3 * L), dtype=torch.float64)
        cross.all_gather(everyone, mine)
        table = everyone.view(K, 1 + 3 * L)
        records = table[:, 1:].reshape(K, L, 3).tolist()
        by_rank = {topo.nodes[i][j]: records[i][j] for i in range(K) for j in range(L)}
        rows = [by_rank[r] for r in range(topo.world_size)]
        lengths = [int(r[1]) for r in rows]
        if len(set(lengths)) != 1:
            raise ValueError(
                "HierarchicalExchange: every rank must pass the same number of elements, got "
                f"{lengths} (rank order)"
            )
        bad = [r for r, row in enumerate(rows) if not row[0]]
        if bad:
            raise NonFiniteError(bad)
        unsafe = [r for r, row in enumerate(rows) if not row[2]]
        if lengths[0] and unsafe:
            raise NonFiniteError(unsafe, overflow=True)
        return table[:, 0].to(torch.float32)

    def _buffers(
        self, numel: int, padded: int, device: torch.device, stages: int
    ) -> dict[str, Any]:
        """Scratch per bucket size, kept between calls (``send``'s pad tail is zeroed once, never
        written); steps 2–3's byte buffers only for one stage (in stages each has its own)."""
        if numel not in self._scratch or self._scratch[numel]["z"].device != device:
            L, K = self.local_size, self.num_nodes
            S = padded // L
            row_bytes = S // 8 + 4 * K
            u8 = {"dtype": torch.uint8, "device": device}
            f32 = {"dtype": torch.float32, "device": device}
            shared = hasattr(self.local_backend, "reduce_scatter_mean_")
            scratch = {
                "send": None if shared or padded == numel else torch.zeros(padded, **f32),
                "recv": None if shared else torch.empty(L, S, **f32),
                "z": torch.empty(S, **f32),
            }
            if stages == 1:
                scratch.update(
                    bits=torch.empty(S // 8, **u8),
                    recv_bits=torch.empty(K, S // (8 * K), **u8),
                    server=torch.empty(S // (8 * K) + 4, **u8),
                    got=torch.empty(K, S // (8 * K) + 4, **u8),
                    row=torch.empty(row_bytes, **u8),
                    gathered=torch.empty(L, row_bytes, **u8),
                )
            self._scratch[numel] = scratch
        return self._scratch[numel]

    def __repr__(self) -> str:
        t = self.topology
        return (
            f"HierarchicalExchange({t.num_nodes} nodes × {t.local_size} ranks, "
            f"local={self.local_backend!r}, cross={self.cross_backend!r})"
        )
