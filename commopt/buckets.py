"""Flat buckets: many parameter tensors laid end to end in a few large fp32 buffers.

Communication cost is dominated by per-call latency for small tensors, so the optimizers move
whole buckets, never single tensors. A bucket never mixes devices; it may span param groups,
and each group's parameters occupy one contiguous *segment* of it, so per-group
hyperparameters apply to a slice of the flat buffer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

import torch

__all__ = ["DEFAULT_BUCKET_NUMEL", "Bucket", "Segment", "build_buckets"]

# 2**25 fp32 elements = 128 MiB: large enough that latency is negligible against bandwidth
# even on a fast link, small enough to bound the temporary buffers of one compressed call.
DEFAULT_BUCKET_NUMEL = 1 << 25


@dataclasses.dataclass(frozen=True)
class Segment:
    """Parameters of param group ``group`` stored in ``[start, stop)`` of the bucket."""

    group: int
    start: int
    stop: int
    params: tuple[torch.Tensor, ...]

    @property
    def slice(self) -> slice:
        """This segment's elements in the bucket's flat buffers."""
        return slice(self.start, self.stop)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One view of ``flat`` (the whole bucket's buffer) per parameter of this segment."""
        out, offset = [], self.start
        for p in self.params:
            out.append(flat[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out


@dataclasses.dataclass
class Bucket:
    """An ordered run of parameters and where each lives in the flat buffer."""

    params: list[torch.Tensor]
    offsets: list[int]
    segments: list[Segment]
    numel: int
    device: torch.device
    #: the global step before its parameters joined (their group's, or their own cohort's)
    first_step: int = 0

    def new_buffer(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zero flat buffer of the bucket's length."""
        return torch.zeros(self.numel, dtype=dtype, device=self.device)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One view of ``flat`` per parameter, shaped like it."""
        return [
            flat[o : o + p.numel()].view(p.shape)
            for p, o in zip(self.params, self.offsets, strict=True)
        ]


def build_buckets(
    param_groups: Sequence[dict],
    max_numel: int | None = DEFAULT_BUCKET_NUMEL,
    new_bucket_at: Collection[int] = (),
) -> list[Bucket]:
    """Lay out every parameter of ``param_groups`` in order into buckets of at most ``max_numel``
    elements (``None``: one bucket per device). A single larger tensor gets a bucket of its own,
    and the groups whose indices are in ``new_bucket_at`` start new buckets.
    """
    buckets: list[Bucket] = []
    open_by_device: dict[torch.device, Bucket] = {}
    for gi, group in enumerate(param_groups):
        if gi in new_bucket_at:
            open_by_device.clear()
        for p in group["params"]:
            bucket = open_by_device.get(p.device)
            if bucket is None or (
                max_numel is not None and bucket.numel and bucket.numel + p.numel() > max_numel
            ):
                bucket = Bucket([], [], [], 0, p.device)
                buckets.append(bucket)
                open_by_device[p.device] = bucket
            bucket.params.append(p)
            bucket.offsets.append(bucket.numel)
            last = bucket.segments[-1] if bucket.segments else None
            stop = bucket.numel + p.numel()
            if last is not None and last.group == gi:
                bucket.segments[-1] = Segment(gi, last.start, stop, (*last.params, p))
            else:
                bucket.segments.append(Segment(gi, bucket.numel, stop, (p,)))
            bucket.numel = stop
    return buckets
