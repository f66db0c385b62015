r"""SPEC §1 steps 4–9 in stages, so that the wire and the per-element work overlap.

:func:`commopt.compressed_allreduce` computes the worker scale over the whole buffer and agrees
on it (steps 1–3) as always; then, with ``pipeline=P`` stages, each server chunk
[j·M, (j+1)·M) is cut into P ranges of m elements (m a multiple of :data:`ALIGN`; the last
range may be shorter), and range k of *every* chunk forms stage k:

1. worker: for k = 0 … P−1, pack range k of every chunk (``pack_compensated_``, which also
   updates e there) and start the all-to-all of those n rows; packing stage k+1 runs while
   stage k is on the wire;
2. server: as stage k arrives, average it into f (c_s = a + f); the average of stage k runs
   while stages k+1 … are on the wire;
3. t = ‖c_s‖₂/√M over the whole chunk (one scale per chunk, as unpipelined); start the
   all-gather of the n server scales;
4. server: for each stage, pack range k of c_s (f ← c_s − t·sgn(c_s) there) and start its
   all-gather; packing stage k+1 runs while stage k is on the wire;
5. worker: as stage k's signs arrive, unpack them into the output; the unpacking of stage k
   runs while stages k+1 … are on the wire.

Steps 1–4 are :func:`staged_server`, step 5 :func:`unpack_arrivals_`; the hierarchical exchange
runs steps 1–4 on its cross level and, for step 5, gathers each stage inside the node first
(:mod:`commopt.exchange.hierarchical`).

Same bytes, same results. Every element goes through the same fp32 operations as unpipelined;
the scales are the same norms over the same elements (the numba and CuPy kernels keep per-block
sums of squares and add them in the unpipelined order; see ``ServerStages``); and the bytes a rank
sends are those of the unpipelined call, in 2P+2 messages instead of 3 (plus the agreement), so the
wire format is SPEC §1's. A kernel set without ``server_stages`` averages the whole chunk in one
``server_reduce_`` once every stage has arrived: the same collectives in the same order (so ranks
with different kernel sets still match), without overlap on the server.

The stage count depends only on N, n and the ``pipeline`` argument, which every rank must pass
alike. ``pipeline=None`` picks :func:`auto_stages`: one stage (no pipelining) below
:data:`MIN_STAGE` elements per stage, at most :data:`MAX_STAGES`.

On CUDA nothing extra is needed for correctness: the kernels run on torch's current stream,
torch.distributed orders ``async_op=True`` collectives after the current stream's work and
``wait()`` orders later work after them, and MpiBackend synchronizes the stream before MPI
touches a device buffer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from commopt.comm import Backend, all_gather_async, all_to_all_async
from commopt.kernels import Kernels, ServerStages

__all__ = [
    "ALIGN",
    "MAX_STAGES",
    "MIN_STAGE",
    "Arrival",
    "auto_stages",
    "check_stages",
    "stage_ranges",
    "staged_server",
    "unpack_arrivals_",
]

# Stage boundaries within a server chunk fall on multiples of this many elements: whole bytes of
# signs, and whole blocks of the numba kernels (whose per-block sums of squares make t exact).
ALIGN = 4096
# Elements of the buffer per stage below which a stage is not worth its messages (≈ 0.5 ms of
# per-element work and 0.5 MB of signs each way per stage for 4M fp32 elements).
MIN_STAGE = 1 << 22
MAX_STAGES = 8


def check_stages(pipeline: int | None) -> int | None:
    """``pipeline`` itself if it is a stage count ≥ 1 or ``None``, else ``ValueError``."""
    if pipeline is not None and (isinstance(pipeline, bool) or pipeline < 1):
        raise ValueError(f"pipeline must be a stage count >= 1 or None, got {pipeline!r}")
    return pipeline


def auto_stages(padded: int, world_size: int) -> int:
    """The default stage count for a buffer of N = ``padded`` elements over ``world_size`` ranks."""
    if world_size < 2:
        return 1
    return max(1, min(MAX_STAGES, padded // MIN_STAGE))


def stage_ranges(chunk: int, stages: int) -> list[tuple[int, int]]:
    """The ranges [lo, hi) of a server chunk of ``chunk`` elements (a multiple of 8) for
    ``stages`` stages: equal lengths rounded up to :data:`ALIGN`, so possibly fewer stages."""
    if stages < 1:
        raise ValueError(f"pipeline must be a stage count >= 1 or None, got {stages}")
    length = -(-chunk // stages)
    length = max(ALIGN, -(-length // ALIGN) * ALIGN)
    return [(lo, min(chunk, lo + length)) for lo in range(0, chunk, length)]


class _WholeChunk:
    """``ServerStages`` for a kernel set without its own: the stages' signs are collected and
    reduced by one ``server_reduce_`` (the same results as unpipelined; no server overlap)."""

    align = 8

    def __init__(self, kernels: Kernels, server_error: torch.Tensor, n: int) -> None:
        self.kernels, self.f = kernels, server_error
        chunk_bytes = server_error.numel() // 8
        self.recv = torch.empty(n, chunk_bytes, dtype=torch.uint8, device=server_error.device)
        self.bits = torch.empty(chunk_bytes, dtype=torch.uint8, device=server_error.device)
        self.scales: torch.Tensor | None = None

    def average_(self, recv_bits: torch.Tensor, scales: torch.Tensor, lo: int) -> None:
        self.recv[:, lo // 8 : lo // 8 + recv_bits.shape[1]] = recv_bits
        self.scales = scales

    def scale(self) -> torch.Tensor:
        return self.kernels.server_reduce_(self.recv, self.scales, self.f, self.bits)

    def pack_(self, t: torch.Tensor, lo: int, bits: torch.Tensor) -> None:
        del t  # packed already, by server_reduce_
        bits.copy_(self.bits[lo // 8 : lo // 8 + bits.numel()])


class Arrival(NamedTuple):
    """One stage of the servers' signs on its way: range [lo, hi) of every server chunk.

    ``signs`` is [n, (hi − lo)/8] bytes (row j: server j's signs of that range, MSB first), to be
    read only after ``done.wait()``; ``sent`` is this rank's row, kept alive until then.
    """

    lo: int
    hi: int
    signs: torch.Tensor
    done: torch.futures.Future[torch.Tensor]
    sent: torch.Tensor


def staged_server(
    be: Backend,
    kernels: Kernels,
    x: torch.Tensor,
    s: torch.Tensor,
    worker_error: torch.Tensor,
    worker_scales: torch.Tensor,
    server_error: torch.Tensor,
    stages: int,
) -> tuple[torch.Tensor, list[Arrival]]:
    """SPEC §1 steps 4–8 in ``stages`` stages (steps 1–4 of the module docstring).

    ``x`` is this rank's flat fp32 buffer (at most N elements: the rest is the zero pad), ``s``
    its agreed worker scale and ``worker_scales`` everyone's; e (N) and f (N/n) are updated in
    place. Returns the n server scales (arrived) and the stages' server signs, still on the
    wire, in stage order: whoever consumes them (:func:`unpack_arrivals_` unpacks them; the
    hierarchical exchange forwards them inside the node first) overlaps that work with the
    later stages' transfers.
    """
    n = be.world_size
    chunk = server_error.numel()
    numel = x.numel()
    dev = x.device
    stages_of_f = getattr(kernels, "server_stages", None)
    server: ServerStages = (
        stages_of_f(server_error) if stages_of_f else _WholeChunk(kernels, server_error, n)
    )
    ranges = stage_ranges(chunk, stages)

    # 1. worker: pack range k of every chunk, send it; the next stage packs meanwhile.
    phase1 = []
    for lo, hi in ranges:
        send = torch.empty(n, (hi - lo) // 8, dtype=torch.uint8, device=dev)
        for j in range(n):
            a = j * chunk + lo
            xs = x[min(a, numel) : min(a + hi - lo, numel)]  # empty or short in the pad
            kernels.pack_compensated_(xs, s, worker_error[a : a + hi - lo], send[j])
        recv = torch.empty_like(send)
        phase1.append((lo, recv, all_to_all_async(be, recv, send), send))

    # 2. server: average each stage as it arrives (row i of recv = worker i's signs).
    for lo, recv, fut, _send in phase1:
        fut.wait()
        server.average_(recv, worker_scales, lo)
    del phase1

    # 3. one scale over the whole chunk; everyone's scales travel while the signs are packed.
    t = server.scale()
    server_scales = torch.empty(n, dtype=torch.float32, device=dev)
    scales_fut = all_gather_async(be, server_scales, t.reshape(1))

    # 4. server: pack range k of c_s (f updated there) and send it to everyone.
    arrivals = []
    for lo, hi in ranges:
        bits = torch.empty((hi - lo) // 8, dtype=torch.uint8, device=dev)
        server.pack_(t, lo, bits)
        gathered = torch.empty(n, (hi - lo) // 8, dtype=torch.uint8, device=dev)
        arrivals.append(Arrival(lo, hi, gathered, all_gather_async(be, gathered, bits), bits))
    scales_fut.wait()
    return server_scales, arrivals


def unpack_arrivals_(
    kernels: Kernels,
    arrivals: list[Arrival],
    server_scales: torch.Tensor,
    chunk: int,
    y: torch.Tensor,
) -> None:
    """Step 5 of the module docstring (SPEC §1 step 9): y = t_j·sgn for range k of every server
    chunk j (``chunk`` elements each), unpacked as stage k arrives; y's tail past its length is
    the pad and is skipped. y may share :func:`staged_server`'s x: every read of x is done."""
    numel = y.numel()
    for lo, hi, gathered, done, _sent in arrivals:
        done.wait()
        for j in range(server_scales.numel()):
            a = j * chunk + lo
            if a >= numel:
                break
            kernels.unpack_scaled_(
                gathered[j : j + 1], server_scales[j : j + 1], y[a : min(a + hi - lo, numel)]
            )
