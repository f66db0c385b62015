r"""The error-compensated 1-bit allreduce (SPEC §1).

Every rank is a *worker* for the whole buffer and the *server* of one contiguous chunk of it.
Workers send signs of their error-compensated buffer to the servers; each server averages its
chunk, compensates it with its own error and sends the signs of the result back to everyone.
Two error buffers make the compression unbiased over time: the worker error ``e`` (length N)
remembers what this rank's signs failed to say, the server error ``f`` (length N/n) what the
server's signs failed to say.

Wire format: bits MSB-first, numpy ``packbits`` order; the N/8 bytes split row-major into
``[n][N/(8n)]`` chunks, chunk j for rank j; scales as fp32. This is DeepSpeed's layout, but not
always its buffer: DeepSpeed pads to a multiple of n·lcm(n, 8), which equals 8n only for
n ∈ {1, 2, 4, 8}, and its optimizers compress each tensor (or param group) with its own scale
where commopt's compress a whole bucket, so packed buffers are interchangeable only for the
same buffer at those world sizes (SPEC §8). Bytes sent per rank per call ≈ 2·(n−1)/n·N/8 + O(n),
32× less than a ring allreduce of the fp32 buffer.
"""

from __future__ import annotations

import torch

from commopt import pipelined
from commopt.comm import Backend, resolve_backend
from commopt.kernels import Kernels, get_kernels
from commopt.output_pool import output_like

__all__ = [
    "NonFiniteError",
    "compressed_allreduce",
    "compressed_allreduce_and_scale",
    "compression_bytes",
    "padded_size",
]

# L travels with the worker scale as two fp32 numbers, each below 2**24 so exactly representable.
_LOW_BITS = 20


# A worker scale above 2**127/n or a server error above 2**127 could overflow fp32 in the
# server's a + f, or in f's update, from finite inputs: refused before any state changes.
_SAFE_LIMIT = 2.0**127


class NonFiniteError(FloatingPointError):
    """The buffer to compress held inf/NaN on at least one rank, or finite values so large that
    compressing them would overflow fp32 (``overflow=True``); raised on every rank alike.

    Nothing was changed: the worker and server errors are as they were before the call.
    """

    def __init__(self, ranks: list[int], *, overflow: bool = False) -> None:
        self.ranks = ranks
        self.overflow = overflow
        what = (
            "a worker scale above 2**127/n or a server error above 2**127 (fp32 would overflow)"
            if overflow
            else "non-finite values in the buffer to compress"
        )
        super().__init__(f"{what} on rank(s) {ranks}; worker and server errors were left unchanged")


def overflow_safe(scale: torch.Tensor, server_error: torch.Tensor | None, fan_in: int) -> bool:
    """Whether one server's average of ``fan_in`` scales ≤ ``scale``, plus ``server_error``, and
    the update of that error stay finite in fp32: s ≤ 2^127/fan_in and max|f| ≤ 2^127 (NaN
    fails). Then |a + f| ≤ 2^128 and |f'| = ||c_s| − t| ≤ max|c_s|."""
    return bool(_overflow_flag(scale, server_error, fan_in))


def _overflow_flag(
    scale: torch.Tensor, server_error: torch.Tensor | None, fan_in: int
) -> torch.Tensor:
    """:func:`overflow_safe` as a 0-dim bool tensor on the scale's device (no host read)."""
    ok = scale[0] <= _SAFE_LIMIT / fan_in
    if server_error is not None and server_error.numel():
        low, high = torch.aminmax(server_error)  # one pass; |·|'s max would be two
        ok = ok & (low >= -_SAFE_LIMIT) & (high <= _SAFE_LIMIT)
    return ok


def padded_size(numel: int, world_size: int) -> int:
    """N: ``numel`` rounded up to a multiple of 8·world_size.

    A multiple of 8·n makes every server chunk N/n a whole number of bytes once packed.
    """
    if numel < 0 or world_size < 1:
        raise ValueError(
            f"padded_size needs numel >= 0 and world_size >= 1, got {numel}, {world_size}"
        )
    unit = 8 * world_size
    return -(-numel // unit) * unit


def _check_error_buffer(
    name: str, buf: torch.Tensor, numel: int, like: torch.Tensor, how: str
) -> None:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {buf.dtype}")
    if buf.numel() != numel:
        raise ValueError(f"{name} has {buf.numel()} elements; expected {how} = {numel}")
    if buf.device != like.device:
        raise ValueError(f"{name} is on {buf.device} but the tensor is on {like.device}")
    if not buf.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def compressed_allreduce(
    tensor: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    backend: Backend | None = None,
    *,
    out: torch.Tensor | None = None,
    pipeline: int | None = None,
) -> torch.Tensor:
    r"""Average ``tensor`` over all ranks, sending one bit per element each way.

    With x this rank's buffer (L elements), N = ``padded_size(L, n)`` and M = N/n:

    1. c = pad(x) + e
    2. s_r = ‖c‖₂ / √N
    3. phase 1a: all-gather (s_r, L, safe?) — every rank checks that L agrees, that every s is
       finite (an inf/NaN anywhere makes some s non-finite) and that no scale or server error
       could overflow fp32 (:func:`overflow_safe`) before anything changes
    4. e ← c − s_r·sgn(c); bits = pack(c ≥ 0), chunk j for rank j
    5. phase 1b: all-to-all of the sign chunks
    6. server r: a = (1/n)·Σ_i s_i·sgn_i over its chunk
    7. c_s = a + f; t_r = ‖c_s‖₂/√M; f ← c_s − t_r·sgn(c_s); pack sgn(c_s)
    8. phase 2: all-gather of the server sign chunks and of the n server scales
    9. y = concat_j t_j·sgn(chunk_j), first L elements, shaped like ``tensor``

    The output is bit-identical on every rank. With one rank, ``tensor`` is returned (copied)
    unchanged and nothing is communicated.

    Args:
        tensor: this rank's buffer, any shape, floating point (computed in fp32).
        worker_error: e, fp32, ``padded_size(tensor.numel(), n)`` elements; updated in place.
        server_error: f, fp32, N // n elements; updated in place.
        backend: where to communicate; ``None`` resolves as in :func:`commopt.comm.resolve_backend`.
        out: where to write y (may be ``tensor`` itself); a new tensor if ``None`` (on CPU,
            the buffer of an earlier result the caller has dropped, if any:
            :mod:`commopt.output_pool`).
        pipeline: run steps 4–9 in this many stages, so that packing, averaging and unpacking
            overlap the transfers (:mod:`commopt.pipelined`; same bytes, same result bit for
            bit). ``None`` (default) chooses from the size: no stages below 8M elements, up to
            8 for large buffers; ``1`` never pipelines. Every rank must pass the same value.

    Returns:
        y, with the shape and dtype of ``tensor``.

    Raises:
        NonFiniteError: inf/NaN in ``tensor`` on any rank, or s > 2^127/n or max|f| > 2^127
            on any rank (``overflow=True``); raised on all ranks, e and f untouched.
        ValueError: error buffers of the wrong size or device, or ranks passing different L.
        TypeError: non-float tensor or non-fp32 error buffers.
    """
    return compressed_allreduce_and_scale(
        tensor, worker_error, server_error, backend, out=out, pipeline=pipeline
    )[0]


def compressed_allreduce_and_scale(
    tensor: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    backend: Backend | None = None,
    *,
    out: torch.Tensor | None = None,
    pipeline: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`compressed_allreduce`, also returning this rank's worker scale s_r (a 1-element
    fp32 tensor; ``None`` when nothing was compressed: one rank, or no elements).

    ‖c‖² = N·s_r² then comes for free, which is what the optimizers' compression-error
    diagnostic needs (``comm_stats()``).
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise TypeError(f"compressed_allreduce needs a floating-point tensor, got {tensor!r:.80}")
    be = resolve_backend(backend)
    n = be.world_size
    numel = tensor.numel()
    padded = padded_size(numel, n)
    _check_error_buffer("worker_error", worker_error, padded, tensor, f"padded_size({numel}, {n})")
    _check_error_buffer(
        "server_error", server_error, padded // n, tensor, f"padded_size({numel}, {n}) // {n}"
    )
    pipelined.check_stages(pipeline)
    if out is None:  # a released result's buffer, on CPU (fresh pages cost more than the call)
        out = output_like(tensor)
    elif out.shape != tensor.shape or out.dtype != tensor.dtype:
        raise ValueError(
            f"out must match the tensor's shape and dtype ({tensor.shape}, {tensor.dtype})"
        )

    if n == 1:
        if not bool(torch.isfinite(tensor).all()):
            raise NonFiniteError([0])
        return (out.copy_(tensor) if out is not tensor else out), None

    kernels = get_kernels(tensor.device)
    x = tensor.reshape(-1).float()

    # 1–2. s = ‖pad(x) + e‖/√N; c = pad(x) + e is not stored (step 4 recomputes it, exactly).
    s = (
        kernels.scale(x, worker_error)
        if padded
        else torch.zeros(1, dtype=torch.float32, device=x.device)
    )

    # 3. phase 1a: (s, L, safe?) from everyone; agree on L, finiteness and the fp32 range
    # before touching e or f.
    worker_scales = _agree(be, s, numel, server_error)
    if padded == 0:
        return out, None

    y = out.view(-1) if out.dtype == torch.float32 and out.is_contiguous() else torch.empty_like(x)
    stages = pipelined.auto_stages(padded, n) if pipeline is None else pipeline
    if stages > 1:
        # 4–9 in stages, transfers overlapping the per-element work (commopt.pipelined).
        server_scales, arrivals = pipelined.staged_server(
            be, kernels, x, s, worker_error, worker_scales, server_error, stages
        )
        pipelined.unpack_arrivals_(kernels, arrivals, server_scales, server_error.numel(), y)
    else:
        # 4. e ← c − s·sgn(c); signs packed MSB first, chunk j for rank j.
        bits = torch.empty(padded // 8, dtype=torch.uint8, device=x.device)
        kernels.pack_compensated_(x, s, worker_error, bits)
        # 5–8. the servers' round; 9. y = concat_j t_j·sgn(chunk_j)[:L].
        all_bits, server_scales = _server_round(be, kernels, bits, worker_scales, server_error)
        kernels.unpack_scaled_(all_bits, server_scales, y)
    if y.data_ptr() != out.data_ptr():
        out.copy_(y.view(out.shape))
    return out, s


def _agree(
    be: Backend, s: torch.Tensor, numel: int, server_error: torch.Tensor | None = None
) -> torch.Tensor:
    """Phase 1a: all-gather (s, L, safe?); raise on every rank alike unless every rank passed
    the same L, a finite s, and a scale and server error that cannot overflow fp32
    (:func:`overflow_safe`; ``server_error=None``: nothing will be compressed, only s counts).
    Returns the n worker scales."""
    n = be.world_size
    # Built on the device (fills and one device copy): the all-gathered table below is the one
    # read the host makes per call.
    meta = torch.empty(4, dtype=torch.float32, device=s.device)
    meta[0] = s[0]
    meta[1] = float(numel & ((1 << _LOW_BITS) - 1))
    meta[2] = float(numel >> _LOW_BITS)
    meta[3] = _overflow_flag(s, server_error, n) if server_error is not None else 1.0
    all_meta = torch.empty(4 * n, dtype=torch.float32, device=s.device)
    be.all_gather(all_meta, meta)
    all_meta = all_meta.view(n, 4)
    meta_host = all_meta.cpu()
    lengths = [int(lo) + (int(hi) << _LOW_BITS) for lo, hi in meta_host[:, 1:3].tolist()]
    if len(set(lengths)) != 1:
        raise ValueError(
            "compressed_allreduce: every rank must pass the same number of elements, got "
            f"{lengths} (rank order)"
        )
    finite = torch.isfinite(meta_host[:, 0])
    if not bool(finite.all()):
        raise NonFiniteError([r for r in range(n) if not finite[r]])
    unsafe = [r for r in range(n) if not meta_host[r, 3]]
    if unsafe and numel:
        raise NonFiniteError(unsafe, overflow=True)
    return all_meta[:, 0].contiguous()


def _server_round(
    be: Backend,
    kernels: Kernels,
    bits: torch.Tensor,
    worker_scales: torch.Tensor,
    server_error: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC §1 steps 5–8 from this rank's packed worker signs (N/8 bytes): all-to-all, the
    server's average compensated by f (f updated), all-gather of the server signs and scales.
    Returns (all_bits [n, N/(8n)], server_scales [n])."""
    n = be.world_size
    chunk_bytes = bits.numel() // n
    # 5. phase 1b: row i of recv = worker i's signs for my server chunk.
    recv = torch.empty(n, chunk_bytes, dtype=torch.uint8, device=bits.device)
    be.all_to_all(recv, bits.view(n, chunk_bytes))

    # 6–7. server: average, compensate with f, re-compress.
    server_bits = torch.empty(chunk_bytes, dtype=torch.uint8, device=bits.device)
    t = kernels.server_reduce_(recv, worker_scales, server_error, server_bits)

    # 8. phase 2: everyone gets every server's signs and scale.
    all_bits = recv  # reuse: same shape [n, N/(8n)]
    be.all_gather(all_bits, server_bits)
    server_scales = torch.empty(n, dtype=torch.float32, device=bits.device)
    be.all_gather(server_scales, t.reshape(1))
    return all_bits, server_scales


def compression_bytes(numel: int, world_size: int) -> int:
    """Modelled bytes one rank sends per call (SPEC §7): 2·(n−1)/n·N/8 plus the scales."""
    n = world_size
    if n == 1:
        return 0
    padded = padded_size(numel, n)
    return 2 * (n - 1) * padded // (8 * n) + (n - 1) * (4 + 1) * 4
