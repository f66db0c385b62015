r"""EControl error feedback on the workers of the 1-bit allreduce (Gao, Islamov, Stich, ICLR 2024,
arXiv:2311.05645).

The same wire format and bytes per call as :func:`commopt.compressed.compressed_allreduce`
(SPEC §1); only the worker's state and output differ: each rank compresses the difference between
its buffer and an estimate of it, and the output is a running estimate of the average. The
servers' round (steps 5–8) and the agreement on length and finiteness are SPEC §1's own.
"""

from __future__ import annotations

import torch

from commopt.comm import Backend, resolve_backend
from commopt.compressed import (
    NonFiniteError,
    _agree,
    _check_error_buffer,
    _server_round,
    padded_size,
)
from commopt.kernels import get_kernels

__all__ = ["econtrol_allreduce_"]


def econtrol_allreduce_(
    tensor: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    worker_estimate: torch.Tensor,
    mean_estimate: torch.Tensor,
    started: torch.Tensor,
    eta: float,
    backend: Backend | None = None,
) -> torch.Tensor | None:
    r"""Average ``tensor`` (1-D fp32, replaced in place) over all ranks with EControl error
    feedback on the workers (Gao, Islamov, Stich, ICLR 2024, arXiv:2311.05645).

    EControl compresses the *difference* between the buffer and a per-rank estimate h of it
    (EF21's idea), and adds the worker error back only with weight η. With x this rank's buffer
    (L elements), N = ``padded_size(L, n)``, M = N/n, h this rank's estimate and ĥ the estimate
    of the average (identical on every rank):

    First call (``started`` is 0): h = pad(x); ĥ = (1/n)·Σ_i pad(x_i) by one fp32 all-reduce;
    e and f stay 0; started ← 1; y = ĥ[:L] (the paper's h_0 = g_0, so the first output is exact).

    Every later call, SPEC §1 with a different worker (steps 1–4) and output (step 9):

    1. d = pad(x) − h;  c = d + η·e
    2. s_r = ‖c‖₂/√N
    3. phase 1a: all-gather (s_r, L), agree on L and finiteness before anything changes
    4. Δ = s_r·sgn(c);  e ← (c − Δ) + (1 − η)·e  (= e + d − Δ);  h ← h + Δ;  bits = pack(c ≥ 0)
    5–8. unchanged: the servers average Δ over workers and compress it with their classic
       error f (c_s = a + f; t = ‖c_s‖/√M; f ← c_s − t·sgn(c_s)); signs and scales all-gathered
    9. ĥ ← ĥ + concat_j t_j·sgn(chunk_j);  y = ĥ[:L]

    The wire format and bytes per call are SPEC §1's; only the state differs. With η = 1 and
    h ≡ 0 step 4 is the classic worker; with η = 0 it is EF21 (no error feedback at all).
    The server side keeps classic error feedback: it compresses the average *increment* of the
    estimates, and f carries what its signs missed, so ĥ = (1/n)·Σ_i h_i − f (on each chunk).

    Args:
        tensor: this rank's buffer, 1-D fp32 contiguous; overwritten with y.
        worker_error: e, N elements. All five state tensors are fp32, zero-initialised by the
            caller and updated in place; zeroing all of them restarts the feedback.
        server_error: f, N/n elements.
        worker_estimate: h, N elements (this rank's own).
        mean_estimate: ĥ, N elements (bit-identical on every rank).
        started: 1 element, 0 before the first call.
        eta: η ≥ 0, the strength of the error feedback.
        backend: where to communicate; ``None`` resolves as in :func:`compressed_allreduce`.

    Returns:
        s_r (1-element fp32) when a compressed call ran; ``None`` for the exact first call, with
        one rank, or with no elements.

    Raises:
        NonFiniteError: inf/NaN in ``tensor`` on any rank (raised on all ranks; state untouched).
        ValueError: buffers of the wrong size or device, ranks passing different L, or η < 0.
        TypeError: a non-fp32 tensor or buffer.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32:
        raise TypeError(f"econtrol_allreduce_ needs an fp32 tensor, got {tensor!r:.80}")
    if tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError("econtrol_allreduce_ needs a 1-D contiguous tensor")
    if not eta >= 0.0:
        raise ValueError(f"Invalid eta: {eta} (must be >= 0)")
    be = resolve_backend(backend)
    n = be.world_size
    numel = tensor.numel()
    padded = padded_size(numel, n)
    how = f"padded_size({numel}, {n})"
    _check_error_buffer("worker_error", worker_error, padded, tensor, how)
    _check_error_buffer("server_error", server_error, padded // n, tensor, f"{how} // {n}")
    _check_error_buffer("worker_estimate", worker_estimate, padded, tensor, how)
    _check_error_buffer("mean_estimate", mean_estimate, padded, tensor, how)
    _check_error_buffer("started", started, 1, tensor, "1")
    if n == 1:
        if not bool(torch.isfinite(tensor).all()):
            raise NonFiniteError([0])
        return None
    kernels = get_kernels(tensor.device)
    x = tensor
    zeros = torch.zeros_like(worker_error)
    if padded == 0:
        _agree(be, torch.zeros(1, dtype=torch.float32, device=x.device), numel)
        return None

    if not bool(started[0]):
        # The paper's h_0 = g_0: one exact round. Agree on L and finiteness first (the scale
        # of pad(x) alone is finite iff x is); nothing is compressed, so no scale is returned.
        _agree(be, kernels.scale(x, zeros), numel)
        worker_estimate.zero_()[:numel].copy_(x)
        mean_estimate.copy_(worker_estimate)
        be.all_reduce(mean_estimate, "avg")
        started.fill_(1.0)
        x.copy_(mean_estimate[:numel])
        return None

    # 1. d = pad(x) − h; c = d + η·e (new buffers: nothing in the state changes before step 3).
    d = torch.neg(worker_estimate)
    d[:numel].add_(x)
    c = torch.add(d, worker_error, alpha=eta) if eta != 1.0 else d + worker_error
    # 2–3. s = ‖c‖/√N, then agree on L and finiteness.
    s = kernels.scale(c, zeros)
    worker_scales = _agree(be, s, numel, server_error)
    # 4. bits = pack(c ≥ 0) and r = c − Δ; e ← r + (1 − η)·e; h ← h + Δ with Δ = ±s exactly.
    bits = torch.empty(padded // 8, dtype=torch.uint8, device=x.device)
    residual = d  # d is not needed any more: reuse its memory for c − Δ
    kernels.pack_worker_(c, s, residual, bits)
    if eta != 1.0:
        residual.add_(worker_error, alpha=1.0 - eta)
    worker_error.copy_(residual)
    worker_estimate.add_(torch.where(c >= 0, s, -s))
    # 5–8. the servers' round, classic; 9. ĥ ← ĥ + what they sent; y = ĥ[:L].
    all_bits, server_scales = _server_round(be, kernels, bits, worker_scales, server_error)
    increment = c  # c is not needed any more
    kernels.unpack_scaled_(all_bits, server_scales, increment)
    mean_estimate.add_(increment)
    x.copy_(mean_estimate[:numel])
    return s
