"""Flat buckets: parameters laid end to end, per-group segments, size caps, device split."""

from __future__ import annotations

import pytest
import torch

from commopt.buckets import DEFAULT_BUCKET_NUMEL, build_buckets


def params(*shapes: tuple[int, ...], device: str = "cpu") -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(s, device=device)) for s in shapes]


def ids(tensors) -> list[int]:
    """Identities (tensor == tensor is elementwise, so compare lists of tensors by id)."""
    return [id(t) for t in tensors]


def test_one_bucket_in_order_with_offsets():
    ps = params((3,), (2, 2), (5,))
    (bucket,) = build_buckets([{"params": ps}], max_numel=None)
    assert ids(bucket.params) == ids(ps)
    assert bucket.offsets == [0, 3, 7]
    assert bucket.numel == 12
    assert bucket.device == torch.device("cpu")
    assert [(s.group, s.start, s.stop, len(s.params)) for s in bucket.segments] == [(0, 0, 12, 3)]


def test_segments_follow_param_groups():
    g0, g1, g2 = (
        params((4,), (2,)),
        params(
            (3, 1),
        ),
        params((6,), (1,)),
    )
    (bucket,) = build_buckets([{"params": g0}, {"params": g1}, {"params": g2}], max_numel=None)
    spans = [(s.group, s.start, s.stop) for s in bucket.segments]
    assert spans == [(0, 0, 6), (1, 6, 9), (2, 9, 16)]
    assert [ids(s.params) for s in bucket.segments] == [ids(g0), ids(g1), ids(g2)]
    # Segments tile the bucket exactly, and each parameter sits inside its group's segment.
    for seg in bucket.segments:
        for p in seg.params:
            offset = bucket.offsets[ids(bucket.params).index(id(p))]
            assert seg.start <= offset and offset + p.numel() <= seg.stop


def test_size_cap_splits_buckets_and_big_tensor_gets_its_own():
    ps = params((4,), (4,), (4,), (20,), (1,))
    buckets = build_buckets([{"params": ps[:2]}, {"params": ps[2:]}], max_numel=8)
    assert [b.numel for b in buckets] == [8, 4, 20, 1]
    assert [ids(b.params) for b in buckets] == [
        ids(ps[:2]),
        ids(ps[2:3]),
        ids(ps[3:4]),
        ids(ps[4:]),
    ]
    assert [(s.group, s.start, s.stop) for s in buckets[1].segments] == [(1, 0, 4)]
    assert all(b.offsets[0] == 0 for b in buckets)
    assert sum(b.numel for b in buckets) == sum(p.numel() for p in ps)


def test_devices_never_mix():
    cpu, meta = params((3,), (2,)), params((5,), device="meta")
    buckets = build_buckets([{"params": [cpu[0], meta[0], cpu[1]]}], max_numel=None)
    by_device = {b.device.type: b for b in buckets}
    assert set(by_device) == {"cpu", "meta"}
    assert ids(by_device["cpu"].params) == ids(cpu) and by_device["cpu"].offsets == [0, 3]
    assert ids(by_device["meta"].params) == ids(meta)


def test_views_alias_the_flat_buffer():
    ps = params((2, 3), (4,))
    (bucket,) = build_buckets([{"params": ps}])
    flat = bucket.new_buffer()
    assert flat.dtype == torch.float32 and flat.shape == (10,) and not flat.any()
    views = bucket.views(flat)
    assert [v.shape for v in views] == [(2, 3), (4,)]
    views[1].fill_(2.0)
    views[0][1, 2] = 5.0
    assert flat.tolist() == [0, 0, 0, 0, 0, 5, 2, 2, 2, 2]
    assert bucket.new_buffer(torch.float64).dtype == torch.float64


def test_default_cap_is_documented_size():
    assert DEFAULT_BUCKET_NUMEL == 1 << 25
    (bucket,) = build_buckets([{"params": params((7,))}])
    assert bucket.numel == 7


@pytest.mark.parametrize("cap", [1, 5, 64])
def test_every_parameter_exactly_once(cap):
    ps = params(*[(k,) for k in (3, 9, 1, 4, 4, 12, 2)])
    buckets = build_buckets([{"params": ps[:3]}, {"params": ps[3:]}], max_numel=cap)
    seen = [p for b in buckets for p in b.params]
    assert ids(seen) == ids(ps)
    for b in buckets:
        assert b.numel <= cap or len(b.params) == 1
