"""Flat buckets: many parameter tensors laid end to end in a few large fp32 buffers.

Communication cost is dominated by per-call latency for small tensors, so the optimizers move
whole buckets, never single tensors. A bucket never mixes devices; it may span param groups,
and each group's parameters occupy one contiguous *segment* of it, so per-group
hyperparameters apply to a slice of the flat buffer.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Collection, Iterable, Iterator, Sequence

import torch
from torch.distributed.tensor import DTensor

from commopt.sharding import Sharding, local

__all__ = ["DEFAULT_BUCKET_NUMEL", "Bucket", "Segment", "build_buckets", "local_shards"]

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
            shard = local(p)
            out.append(flat[offset : offset + shard.numel()].view(shard.shape))
            offset += shard.numel()
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
    #: each parameter's whole element count (a sharded one's, not its shard's)
    tensor_numels: list[int] = dataclasses.field(default_factory=list)
    #: the groups of sharded parameters (their per-tensor sums need the shard group); None:
    #: every tensor is whole here
    sharding: Sharding | None = None

    def new_buffer(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zero flat buffer of the bucket's length."""
        return torch.zeros(self.numel, dtype=dtype, device=self.device)

    def stand_in(
        self, proxies: dict[int, torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[Segment]]:
        """Replace parameters by stand-ins (``id(p)`` → tensor) in ``params`` and the segments;
        returns the ``(params, segments)`` to put back."""
        old = self.params, self.segments
        self.params = [proxies.get(id(p), p) for p in self.params]
        self.segments = [
            dataclasses.replace(seg, params=tuple(proxies.get(id(p), p) for p in seg.params))
            for seg in self.segments
        ]
        return old

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One view of ``flat`` per parameter, shaped like it."""
        return [
            flat[o : o + shard.numel()].view(shard.shape)
            for shard, o in zip(map(local, self.params), self.offsets, strict=True)
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
    filled: dict[int, int] = {}  # id(bucket) → what counts against max_numel
    for gi, group in enumerate(param_groups):
        if gi in new_bucket_at:
            open_by_device.clear()
        for p in group["params"]:
            shard = local(p)  # (a sharded parameter: this rank's shard is what it stores)
            size = _cap_size(p, shard)
            bucket = open_by_device.get(shard.device)
            if bucket is None or (
                max_numel is not None
                and filled[id(bucket)]
                and filled[id(bucket)] + size > max_numel
            ):
                bucket = Bucket([], [], [], 0, shard.device)
                buckets.append(bucket)
                open_by_device[shard.device] = bucket
                filled[id(bucket)] = 0
            filled[id(bucket)] += size
            bucket.params.append(p)
            bucket.offsets.append(bucket.numel)
            bucket.tensor_numels.append(p.numel())
            last = bucket.segments[-1] if bucket.segments else None
            stop = bucket.numel + shard.numel()
            if last is not None and last.group == gi:
                bucket.segments[-1] = Segment(gi, last.start, stop, (*last.params, p))
            else:
                bucket.segments.append(Segment(gi, bucket.numel, stop, (p,)))
            bucket.numel = stop
    return buckets


def _cap_size(p: torch.Tensor, shard: torch.Tensor) -> int:
    """What ``p`` counts against a bucket's cap: its element count, or for a sharded one its
    whole count over the shard count, the same on every rank of the shard group (its own shard
    may be shorter, or empty), so that every shard rank lays out the same buckets."""
    if isinstance(p, DTensor):
        return -(-p.numel() // p.device_mesh.size())
    return shard.numel()


@contextlib.contextmanager
def local_shards(buckets: Iterable[Bucket]) -> Iterator[None]:
    """Inside: each bucket's sharded parameters are replaced by their local shards (plain
    tensors on the same storage, ``.grad`` the local shard of the gradient), so the algorithm
    reads and writes the shards as it would whole parameters. The state stays keyed by the
    parameters themselves."""
    swapped = []
    for bucket in buckets:
        if bucket.sharding is None:  # (whole parameters: nothing to stand in)
            continue
        proxies: dict[int, torch.Tensor] = {}
        for p in bucket.params:
            if isinstance(p, DTensor):
                shard = p.to_local()
                proxy = shard.view(shard.shape)  # a fresh leaf: its .grad is ours to set
                proxy.grad = None if p.grad is None else local(p.grad)
                proxies[id(p)] = proxy
        swapped.append((bucket, bucket.stand_in(proxies)))
    try:
        yield
    finally:
        for bucket, restore in swapped:
            for proxy in bucket.params:
                proxy.grad = None
            bucket.params, bucket.segments = restore
