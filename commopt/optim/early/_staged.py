r"""What the early work of :mod:`commopt.optim.early` writes instead of the optimizer's state,
and how a gradient goes into it (:func:`fold_param_`).

:class:`StagedWork` is one optimizer bucket's progress for one step (which gradients arrived,
were averaged or folded; whether its exchange ran); :class:`StagedBuffers` are the buffers that
work writes, kept from step to step.

Memory, per optimizer bucket of L elements, allocated at first use and kept: a staged gradient
(L fp32) in steps with ``AVERAGE`` work; a staged momentum (L fp32) and staged error buffers (N
+ N/n fp32 for the flat exchange, N = L padded) in steps with ``MOMENTUM`` work. So about 4
bytes per parameter in the warmup and (2 + 1/n)·4 bytes in the compression stage (0/1 Adam's
staged syncs: a staged p′ too, so (3 + 1/n)·4 bytes, :mod:`commopt.optim.zero_one_adam`), on
top of the optimizer's own m, v, e and f."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from commopt.optim.flat_state import FlatState

__all__ = ["StagedBuffers", "StagedWork", "fold_param_"]


class StagedWork:
    """One optimizer bucket's early work for one step."""

    __slots__ = (
        "arrived",
        "averaged",
        "exchanged",
        "failed",
        "folded",
        "future",
        "outcome",
        "round",
        "seen",
        "step",
        "ticket",
    )

    def __init__(self, step: int, round_: int) -> None:
        self.step = step
        self.reset(round_)

    def reset(self, round_: int) -> None:
        """Start the bucket over (a later backward pass of the same step)."""
        self.round = round_  # the backward pass (overlap's rounds of tickets) it belongs to
        self.ticket: int | None = None  # its job's ticket on the communication thread
        self.arrived: set[int] = set()  # parameter indices whose gradient is in the staged g
        self.future: torch.futures.Future[torch.Tensor] | None = None  # the staged g's average
        self.averaged: set[int] = set()  # bucket parameter indices whose gradient arrived averaged
        self.folded: set[int] = set()  # parameter indices whose local gradient is in the staged m
        self.exchanged = False  # the staged m has been through the compressed exchange
        self.failed = False  # ... which found non-finite values on some rank (collective)
        self.outcome: object = None  # what the plan's exchange returned (0/1 Adam's sync)
        self.seen: object = None  # the hyperparameters when its job was queued (overlap)


class StagedBuffers:
    """Per optimizer bucket: the staged gradient, momentum and error buffers (see the module
    docstring for what they cost)."""

    def __init__(self) -> None:
        self._gradient: dict[int, torch.Tensor] = {}  # id(FlatState) → staged gradient
        self._momentum: dict[int, torch.Tensor] = {}  # id(FlatState) → staged m
        self._errors: dict[int, dict[str, torch.Tensor]] = {}  # id(FlatState) → staged e, f
        self._base: dict[int, torch.Tensor] = {}  # id(FlatState) → 0/1 Adam's first p_sync

    def gradient(self, state: FlatState) -> torch.Tensor:
        """The bucket's staged gradient, laid out like the bucket."""
        buf = self._gradient.get(id(state))
        if buf is None:
            buf = self._gradient[id(state)] = state.bucket.new_buffer()
        return buf

    def drop_gradient(self, state: FlatState) -> None:
        """Free the bucket's staged gradient (its steps no longer average gradients)."""
        self._gradient.pop(id(state), None)

    def momentum(self, state: FlatState) -> torch.Tensor:
        """The bucket's staged momentum m' (fp32, the bucket's length)."""
        m = self._momentum.get(id(state))
        if m is None:
            bucket = state.bucket
            m = self._momentum[id(state)] = torch.empty(
                bucket.numel, dtype=torch.float32, device=bucket.device
            )
        return m

    def sync_base(self, state: FlatState) -> torch.Tensor:
        """0/1 Adam's staged p_sync at its first phase-B step (:mod:`.zero_one_adam`)."""
        buf = self._base.get(id(state))
        if buf is None:
            buf = self._base[id(state)] = state.bucket.new_buffer()
        return buf

    def errors_from(self, state: FlatState) -> dict[str, torch.Tensor]:
        """Staged copies of the bucket's committed error buffers (``state.comm``)."""
        staged = self._errors.get(id(state))
        if staged is None:
            staged = self._errors[id(state)] = {
                k: torch.empty_like(v) for k, v in state.comm.items()
            }
        for key, buf in state.comm.items():
            staged[key].copy_(buf)
        return staged

    def swap_errors_into(self, state: FlatState) -> None:
        """Commit the staged error buffers: swap, not copy, so the old buffers are the next
        step's staging space."""
        staged = self._errors[id(state)]
        for key in state.comm:
            state.comm[key], staged[key] = staged[key], state.comm[key]

    def clear(self) -> None:
        """Free everything (the buckets were laid out anew)."""
        self._gradient.clear()
        self._momentum.clear()
        self._errors.clear()
        self._base.clear()


def fold_param_(
    state: FlatState,
    i: int,
    g: torch.Tensor | None,
    staged: torch.Tensor,
    groups: Sequence[dict[str, Any]],
    gradient: bool,
    missing_as_zero: bool,
) -> None:
    """The bucket's i-th parameter into ``staged`` (flat, the bucket's layout), bit for bit as
    ``step()`` would: m′ = β1·m + (1−β1)·g from the committed m, or ``gradient`` (0/1 Adam's
    1-bit steps): g itself. ``g`` None: the parameter has no gradient on this rank (m′ = β1·m,
    or with ``missing_as_zero`` the lerp towards 0 of 1-bit LAMB's ``gather_grads``)."""
    bucket = state.bucket
    start = bucket.offsets[i]
    p = bucket.params[i]
    dst = staged[start : start + p.numel()].view(p.shape)
    if gradient:
        if g is None:
            dst.zero_()
        else:
            dst.copy_(g.reshape(p.shape))
        return
    src = state.flat["exp_avg"][start : start + p.numel()].view(p.shape)
    beta1 = next(
        groups[seg.group]["betas"][0] for seg in bucket.segments if any(q is p for q in seg.params)
    )
    # one pass, out of place: the kernels of lerp_/mul_ in step(), so the same bits
    if g is None and missing_as_zero:
        torch.lerp(src, torch.zeros_like(dst), 1 - beta1, out=dst)
    elif g is None:
        torch.mul(src, beta1, out=dst)
    else:
        torch.lerp(src, g.reshape(p.shape).to(dst.dtype), 1 - beta1, out=dst)
