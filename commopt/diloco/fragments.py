r"""The parameters in fragments, each with its anchor, its outer momentum and its sync schedule.

A fragment is a contiguous run of parameters (in ``param_groups`` order) synced together. It
owns, in fp32 and flat:

- the anchor θ̄ (the parameters at the last sync, identical on every rank);
- the outer momentum b (only when ``outer_momentum > 0``);
- a scratch buffer for the pseudo-gradient Δ = θ̄ − θ, a view of one buffer that every fragment
  shares (:func:`shared_scratch`);
- the per-rank state of its average (the 1-bit exchange's error buffers), per segment: with
  one 1-bit scale per tensor, each tensor is a segment of its own.

Streaming DiLoCo (Douillard et al., 2025) syncs P fragments at staggered steps, so the traffic
of one sync is spread over the interval. Fragment p (0-based) of P syncs at the inner steps
t = W + o_p + k·H, k ≥ 0, with o_p = ⌊(p+1)·H/P⌋: with P = 1, every H steps after warmup.
"""

from __future__ import annotations

import itertools

import torch

from commopt.diloco.averages import PseudoGradientAverage, local_shard

__all__ = ["Fragment", "first_sync_offsets", "shared_scratch", "split_parameters"]


def split_parameters(params: list[torch.Tensor], fragments: int) -> list[list[torch.Tensor]]:
    """``params`` in ``fragments`` contiguous runs of about equal element counts (none empty).

    Raises:
        ValueError: fewer parameters than fragments.
    """
    if fragments > len(params):
        raise ValueError(
            f"fragments={fragments} but only {len(params)} parameter tensor(s) to sync: a "
            "fragment is made of whole tensors; use fragments <= the number of tensors"
        )
    total = sum(p.numel() for p in params)
    runs: list[list[torch.Tensor]] = [[] for _ in range(fragments)]
    seen, k = 0, 0
    for i, p in enumerate(params):
        # move on once this run holds its share, keeping a tensor for every later run
        while (
            k < fragments - 1
            and runs[k]
            and (seen >= (k + 1) * total / fragments or len(params) - i <= fragments - 1 - k)
        ):
            k += 1
        runs[k].append(p)
        seen += p.numel()
    return runs


def shared_scratch(runs: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Each run's Δ scratch: views of one fp32 buffer per device, the size of the largest run
    there. At most one fragment's sync is in flight at a time (``delay < H/P``), and its average
    is applied before the next fragment's sync starts, so with P fragments Δ takes 4/P bytes
    per parameter instead of 4."""
    places = []
    for run in runs:
        shards = [local_shard(p) for p in run]
        places.append((shards[0].device, sum(t.numel() for t in shards)))
    largest: dict[torch.device, int] = {}
    for device, numel in places:
        largest[device] = max(largest.get(device, 0), numel)
    buffers = {d: torch.zeros(n, dtype=torch.float32, device=d) for d, n in largest.items()}
    return [buffers[device][:numel] for device, numel in places]


def first_sync_offsets(sync_every: int, fragments: int) -> list[int]:
    """o_p = ⌊(p+1)·H/P⌋: the inner step (after warmup) of fragment p's first sync."""
    return [(p + 1) * sync_every // fragments for p in range(fragments)]


class Fragment:
    """One fragment's parameters and fp32 buffers (module docstring)."""

    def __init__(
        self,
        params: list[torch.Tensor],
        average: PseudoGradientAverage,
        momentum: bool,
        per_tensor: bool,
        scratch: torch.Tensor,
    ) -> None:
        self.params = params
        shards = [local_shard(p) for p in params]  # (DTensors: this rank's FSDP2 shard)
        #: each parameter's (local shard's) shape, and where it starts in the flat buffers
        self.shapes = [t.shape for t in shards]
        self.offsets = [0, *itertools.accumulate(t.numel() for t in shards)][:-1]
        self.numel = sum(t.numel() for t in shards)
        device = shards[0].device
        self.anchor = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self.momentum = torch.zeros_like(self.anchor) if momentum else None
        #: Δ's scratch, shared with the other fragments (:func:`shared_scratch`)
        self.delta = scratch
        #: (offset, numel) of each run of Δ averaged on its own: one per tensor (one 1-bit scale
        #: per tensor), or the whole fragment
        self.segments = [(0, self.numel)]
        if per_tensor:
            self.segments = [(o, t.numel()) for o, t in zip(self.offsets, shards, strict=True)]
        #: the average's per-rank state (error buffers), one dict per segment
        self.states = [
            {
                k: torch.zeros(v, dtype=torch.float32, device=device)
                for k, v in average.state_numels(numel).items()
            }
            for _, numel in self.segments
        ]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` cut into one view per parameter (its local shard), shaped like it."""
        return [
            flat[o : o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes, strict=True)
        ]

    @torch.no_grad()
    def gather_params_(self, out: torch.Tensor) -> torch.Tensor:
        """Copy the parameters (any float dtype) into the fp32 buffer ``out``; returns it."""
        for view, p in zip(self.views(out), self.params, strict=True):
            view.copy_(local_shard(p))
        return out

    @torch.no_grad()
    def pseudo_gradient(self) -> torch.Tensor:
        """Δ = θ̄ − θ, in the scratch buffer."""
        self.gather_params_(self.delta)
        return torch.sub(self.anchor, self.delta, out=self.delta)

    @torch.no_grad()
    def outer_step_(
        self, average: torch.Tensor, lr: float, momentum: float, nesterov: bool
    ) -> None:
        r"""θ̄ ← θ̄ − lr·d, with d = Δ̄ (no momentum), or b ← μ·b + Δ̄ and d = Δ̄ + μ·b (Nesterov)
        or d = b; ``torch.optim.SGD``'s arithmetic. Then θ ← θ̄ (cast to each parameter's
        dtype). The same operations on the same bits on every rank: replicas stay identical."""
        d = average
        if self.momentum is not None and momentum != 0.0:
            self.momentum.mul_(momentum).add_(average)
            d = average.add(self.momentum, alpha=momentum) if nesterov else self.momentum
        self.anchor.add_(d, alpha=-lr)
        self.load_params_()

    @torch.no_grad()
    def load_params_(self, flat: torch.Tensor | None = None) -> None:
        """θ ← θ̄, or ← ``flat`` (an fp32 buffer of :meth:`gather_params_`: exact, since fp32
        holds every bf16 and fp16 value)."""
        for view, p in zip(
            self.views(self.anchor if flat is None else flat), self.params, strict=True
        ):
            local_shard(p).copy_(view)
