"""commopt.DiLoCo on forked gloo ranks: the device matrix on CPU, the outer loop against a
hand-written one (torch's own SGD as the outer optimizer), hierarchical islands, the traffic
bound at 2, 4 and 8 ranks, non-finite pseudo-gradients, fp16 loss scaling with an overflow on
one rank, ranks that disagree, and a resume through checkpoint files."""

from __future__ import annotations

import functools
import os
import warnings

import pytest
import torch

import commopt
from commopt.compressed import padded_size
from tests.diloco_matrix import check_diloco, run_diloco
from tests.multirank.harness import RankError, run_ranks

TIMEOUT = 240.0
H = 5


def step_check(world: int) -> int:
    """Bytes one rank sends in a sync's step check (an all-gather of three int64 per rank)."""
    return (world - 1) * 3 * 8


def test_matrix_on_four_gloo_ranks() -> None:
    check_diloco(run_ranks(run_diloco, 4, timeout=TIMEOUT))


def _model(width: int = 20) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, width), torch.nn.Tanh(), torch.nn.Linear(width, 3)
    )


def _loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 6, generator=g) + 0.3 * rank  # every rank its own distribution
    first = next(model.parameters())
    x = x.to(first.device, first.dtype)
    return ((model(x) - x[:, :3].cos()) ** 2).mean()


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _by_hand(backend, compression, outer, steps: int, scale: str, fp32_syncs: int):
    """DiLoCo written out: Adam inner steps, Δ = anchor − θ every H steps, averaged by
    ``compressed_allreduce`` (errors kept; one call per tensor with ``scale="tensor"``) or, for
    ``"none"`` and the first ``fp32_syncs`` syncs, an fp32 all-reduce; torch.optim.SGD on the
    anchor."""
    model = _model()
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    anchor = torch.nn.Parameter(_flat(model).clone())
    lr, momentum = outer
    sgd = torch.optim.SGD([anchor], lr=lr, momentum=momentum, nesterov=momentum > 0)
    sizes = [p.numel() for p in model.parameters()] if scale == "tensor" else [anchor.numel()]
    errors = []
    for size in sizes:
        padded = padded_size(size, backend.world_size)
        errors.append((torch.zeros(padded), torch.zeros(padded // backend.world_size)))
    for step in range(1, steps + 1):
        _loss(model, backend.rank, step).backward()
        inner.step()
        inner.zero_grad()
        if step % H == 0:
            delta = anchor.detach() - _flat(model)
            if compression == "onebit" and step // H > fp32_syncs:
                parts = delta.split(sizes)
                delta = torch.cat(
                    [
                        commopt.compressed_allreduce(part, e, f, backend)
                        for part, (e, f) in zip(parts, errors, strict=True)
                    ]
                )
            else:
                backend.all_reduce(delta, "avg")
            anchor.grad = delta
            sgd.step()
            with torch.no_grad():  # a copy: vector_to_parameters would alias the anchor
                torch.nn.utils.vector_to_parameters(anchor.detach().clone(), model.parameters())
    return _flat(model)


def _with_diloco(backend, compression, outer, steps: int, scale: str, fp32_syncs: int):
    model = _model()
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    lr, momentum = outer
    opt = commopt.DiLoCo(
        inner,
        sync_every=H,
        compression=compression,
        outer_lr=lr,
        outer_momentum=momentum,
        scale=scale,
        fp32_syncs=fp32_syncs,
    )
    for step in range(1, steps + 1):
        _loss(model, backend.rank, step).backward()
        opt.step()
        opt.zero_grad()
    return _flat(model), opt.comm_stats()


def _both(backend, compression, outer, scale, fp32_syncs):
    args = (backend, compression, outer, 3 * H, scale, fp32_syncs)
    return _by_hand(*args), *_with_diloco(*args)


@pytest.mark.parametrize(
    ("compression", "outer", "scale", "fp32_syncs"),
    [
        ("onebit", (1.0, 0.0), "tensor", 0),
        ("onebit", (1.0, 0.0), "fragment", 0),
        ("onebit", (0.7, 0.9), "tensor", 0),
        ("onebit", (1.3, 0.0), "tensor", 2),  # 2 syncs in fp32, then 1 bit
        ("none", (0.7, 0.9), "tensor", 0),
        ("none", (1.0, 0.0), "fragment", 0),
    ],
)
def test_equals_the_outer_loop_written_by_hand(compression, outer, scale, fp32_syncs) -> None:
    results = run_ranks(_both, 3, compression, outer, scale, fp32_syncs, timeout=TIMEOUT)
    for by_hand, ours, stats in results:
        assert torch.equal(by_hand, ours)
        assert stats["syncs"] == 3
        fp32 = 2 * 2 / 3 * 4 * stats["parameters"]  # one fp32 all-reduce (ring model)
        onebit = stats["sync_bytes"] - fp32_syncs * fp32 - 3 * step_check(3)
        if compression == "onebit":  # the fp32 syncs counted at fp32, the rest at a fraction
            assert 0 < onebit < (3 - fp32_syncs) * fp32 / 4, stats  # (small tensors: padding)


def _islands(backend, fp32_syncs):
    local = 2
    os.environ.update(
        LOCAL_RANK=str(backend.rank % local),
        LOCAL_WORLD_SIZE=str(local),
        GROUP_RANK=str(backend.rank // local),
    )
    digests = []
    model = _model(width=400)  # large enough that the signs, not the scales, set the bytes
    opt = commopt.DiLoCo(
        torch.optim.Adam(model.parameters(), lr=1e-2),
        sync_every=H,
        topology="hierarchical",
        scale="fragment",  # one exchange, so the bytes below are the signs' and a few scales
        fp32_syncs=fp32_syncs,
    )
    for step in range(1, 2 * H + 1):
        _loss(model, backend.rank, step).backward()
        opt.step()
        opt.zero_grad()
        digests.append(_flat(model))
    node = torch.stack(digests)
    return node, opt.comm_stats(), type(opt.average.exchange).__name__


@pytest.mark.parametrize("fp32_syncs", [0, 1])
def test_hierarchical_islands_average_inside_the_node_every_step_and_sync_across(fp32_syncs):
    results = run_ranks(_islands, 4, fp32_syncs, timeout=TIMEOUT)
    (a, stats, name), (b, _, _), (c, _, _), (d, _, _) = results
    assert name == "HierarchicalExchange"
    assert torch.equal(a, b) and torch.equal(c, d)  # one worker per node, on every step
    assert not torch.equal(a[H - 2], c[H - 2])  # the two nodes drift apart between syncs
    for k in (H - 1, 2 * H - 1):  # and are identical right after each sync
        assert torch.equal(a[k], c[k])
    assert stats["local_bytes"] > 0 and stats["syncs"] == 2
    assert stats["syncs_at_fp32"] == fp32_syncs
    # across nodes each local rank carries half its node's bits, 2·(K−1)/K·(N/L)/8 per sync with
    # K = L = 2, where the flat exchange's ranks send 2·(n−1)/n·N/8 each: 3× the signs (the
    # scales and the records of the hierarchical checks add ~60 bytes here)
    flat = 2 * 3 / 4 * padded_size(stats["parameters"], 4) / 8
    onebit = stats["sync_bytes"] - stats["fp32_sync_bytes"]
    assert (onebit / (stats["syncs"] - fp32_syncs)) - step_check(4) < 0.5 * flat
    # a first sync at fp32 averages over all four ranks: 2·(n−1)/n·4N + the n finiteness flags
    # + the step check
    fp32 = 1.5 * 4 * stats["parameters"] + 12 + step_check(4)
    assert stats["fp32_sync_bytes"] == fp32_syncs * fp32


def _traffic(backend):
    torch.manual_seed(0)
    model = torch.nn.Linear(500, 400)  # 200,400 parameters
    opt = commopt.DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-3), sync_every=50)
    for step in range(1, 201):  # the defaults: the first two syncs at fp32, then two at 1 bit
        g = torch.Generator().manual_seed(step + 7 * backend.rank)
        model(torch.randn(4, 500, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return opt.comm_stats()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_onebit_sends_at_most_two_bits_per_parameter_per_sync_at_any_world_size(world) -> None:
    stats = run_ranks(_traffic, world, timeout=TIMEOUT)
    for s in stats:
        assert s["syncs"] == 4 and s["syncs_at_fp32"] == 2
        # the two fp32 syncs of the defaults at H = 50: each an all-reduce of the N fp32
        # elements, 2·(n−1)/n·4N bytes, an all-gather of the n 4-byte finiteness flags, and
        # the step check
        per_sync = 2 * (world - 1) / world * 4 * s["parameters"] + (world - 1) * 4
        per_sync += step_check(world)
        assert s["fp32_sync_bytes"] == 2 * per_sync, s
        # then the 1-bit syncs: at most 1.05 × 2/H bits per parameter per inner step
        assert s["compressed_bits_per_parameter_per_step"] <= 1.05 * 2 / 50, s
        assert s["compressed_bits_per_parameter_per_step"] >= 2 * (world - 1) / world / 50, s
        whole = 8 * s["sync_bytes"] / (s["parameters"] * 200)
        assert s["bits_per_parameter_per_step"] == pytest.approx(whole, rel=1e-12), s


def _non_finite(backend, compression, bad_rank):
    model = _model()
    opt = commopt.DiLoCo(
        torch.optim.Adam(model.parameters(), lr=1e-2),
        sync_every=2,
        compression=compression,
        outer_momentum=0.5,
        fp32_syncs=0,  # "onebit" at 1 bit from the first sync
    )
    for step in range(1, 3):  # one good sync first
        _loss(model, backend.rank, step).backward()
        opt.step()
        opt.zero_grad()
    before = [
        t.clone()
        for f in opt.parts
        for t in (f.anchor, f.momentum, *(v for s in f.states for v in s.values()))
    ]
    _loss(model, backend.rank, 3).backward()
    opt.step()
    opt.zero_grad()
    if backend.rank == bad_rank:
        with torch.no_grad():
            next(model.parameters())[0, 0] = float("nan")
    _loss(model, backend.rank, 4).backward()
    try:
        opt.step()
    except commopt.NonFiniteError as err:
        after = [
            t
            for f in opt.parts
            for t in (f.anchor, f.momentum, *(v for s in f.states for v in s.values()))
        ]
        unchanged = all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
        return str(err), unchanged
    return None, None


@pytest.mark.parametrize("compression", ["onebit", "none", "bf16"])
def test_a_non_finite_pseudo_gradient_raises_on_every_rank_and_changes_no_outer_state(
    compression,
) -> None:
    for message, unchanged in run_ranks(_non_finite, 3, compression, 1, timeout=TIMEOUT):
        assert message is not None and "rank(s) [1]" in message
        assert unchanged


# -- fp16 loss scaling: GradScaler.step(opt) with an inf on one rank ----------------------------
#: setup → DiLoCo's keywords, the inner optimizer's, and whether the gradients are averaged over
#: every rank before the inner step (then an inf anywhere skips the step everywhere)
SCALED = {
    "flat, onebit": ({"compression": "onebit", "fp32_syncs": 1}, {}, False),
    "flat, none": ({"compression": "none"}, {}, False),
    "flat, unscale_ first": ({"compression": "onebit", "fp32_syncs": 1}, {}, False),
    "flat, fused Adam": ({"compression": "onebit", "fp32_syncs": 1}, {"fused": True}, False),
    "warmup": ({"compression": "onebit", "warmup_steps": 8}, {}, True),
    "islands": ({"compression": "onebit", "topology": "hierarchical"}, {}, True),
}
BAD = {3: 0, H: 1}  # step → the rank whose gradient overflows (step H syncs)


def scaled_run(backend, setup: str, use_scaler: bool, device: str = "cpu"):
    """12 steps; with ``use_scaler`` through GradScaler with an inf where BAD says, else plain,
    with the gradients dropped where that inf would skip the inner step (the reference)."""
    os.environ.update(LOCAL_RANK=str(backend.rank), LOCAL_WORLD_SIZE="2", GROUP_RANK="0")
    kw, inner_kw, averaged = SCALED[setup]
    model = _model().to(device)
    inner = torch.optim.Adam(model.parameters(), lr=1e-2, **inner_kw)
    opt = commopt.DiLoCo(inner, sync_every=H, **kw)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10)  # a power of 2: exact unscaling
    for step in range(1, 13):
        loss = _loss(model, backend.rank, step)
        bad = BAD.get(step) == backend.rank
        if use_scaler:
            scaler.scale(loss).backward()
            if bad:
                next(model.parameters()).grad[0, 0] = float("inf")
            if setup == "flat, unscale_ first":
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            if bad or (averaged and step in BAD):
                opt.zero_grad()  # no gradient: the inner step is a no-op
            opt.step()
        opt.zero_grad()
    return _flat(model).cpu(), opt.comm_stats()["skipped_steps"], scaler.get_scale()


def check_scaled(setup: str, scaled: list, plain: list) -> None:
    """:func:`scaled_run`'s two runs on 2 ranks: the same bits, the skips and scales expected."""
    averaged = SCALED[setup][2]
    for rank, ((weights, skipped, scale), (expected, _, _)) in enumerate(
        zip(scaled, plain, strict=True)
    ):
        assert torch.equal(weights, expected), rank
        own = sum(r == rank for r in BAD.values())
        assert skipped == (len(BAD) if averaged else own), (rank, skipped)
        assert scale == 2.0**10 / 2**own  # the scale backs off where the inf was seen
    # islands of one node of two ranks average every step; the others are between syncs
    assert torch.equal(scaled[0][0], scaled[1][0]) == (setup == "islands")


@pytest.mark.parametrize("setup", list(SCALED))
def test_grad_scaler_skips_an_overflowing_ranks_inner_step_and_keeps_every_rank_on_schedule(
    setup,
) -> None:
    # Without _step_supports_amp_scaling, GradScaler skips step() on the rank that found the
    # inf, which then misses its sync: the other rank waits in it for ever. Here every rank
    # calls step(), the overflowing inner step alone is skipped (on every rank when the
    # gradients were averaged first), and the run is bit for bit the one that dropped it.
    scaled = run_ranks(scaled_run, 2, setup, True, timeout=TIMEOUT)
    plain = run_ranks(scaled_run, 2, setup, False, timeout=TIMEOUT)
    check_scaled(setup, scaled, plain)


def _evaluated(backend, dtype: torch.dtype, look: bool):
    """2 warmup steps, syncs at 7 and 12, one step past (H = 5), a bf16 or fp32 model; with
    ``look``, synced_weights() is entered after every step (in warmup too), and what it showed
    is recorded."""
    model = _model().to(dtype)
    opt = commopt.DiLoCo(
        torch.optim.Adam(model.parameters(), lr=1e-2), sync_every=H, warmup_steps=2
    )
    after_sync, shown = None, []
    for step in range(1, 2 * H + 4):
        _loss(model, backend.rank, step).backward()
        opt.step()
        opt.zero_grad()
        if (step - 2) % H == 0:
            after_sync = _flat(model)
        if look:
            own = _flat(model)
            with opt.synced_weights():
                shown.append((step, _flat(model), after_sync))
            assert torch.equal(_flat(model), own)  # back, bit for bit
    return _flat(model), shown


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_synced_weights_show_the_last_sync_on_every_rank_and_change_nothing(dtype) -> None:
    looked = run_ranks(_evaluated, 2, dtype, True, timeout=TIMEOUT)
    plain = run_ranks(_evaluated, 2, dtype, False, timeout=TIMEOUT)
    for (end, shown), (expected, _) in zip(looked, plain, strict=True):
        assert torch.equal(end, expected)  # looking changed nothing
        for step, weights, after_sync in shown:
            if step > 2:  # after the warmup: the model of the last sync
                assert torch.equal(weights, after_sync), step
    (_, a), (_, b) = looked
    for (step, wa, _), (_, wb, _) in zip(a, b, strict=True):
        assert torch.equal(wa, wb), step  # one model on every rank
    assert not torch.equal(looked[0][0], looked[1][0])  # while the ranks' own ones differ


def _unfrozen(backend):
    """The first layer frozen when DiLoCo is built, unfrozen at step 3; syncs at 5 and 10."""
    model = _model()
    first = list(model[0].parameters())
    for p in first:
        p.requires_grad_(False)
    opt = commopt.DiLoCo(torch.optim.Adam(model.parameters(), lr=1e-2), sync_every=H)
    for step in range(1, 2 * H + 1):
        if step == 3:
            for p in first:
                p.requires_grad_(True)
        _loss(model, backend.rank, step).backward()
        opt.step()
        opt.zero_grad()
    return _flat(model)


def test_a_parameter_unfrozen_after_diloco_was_built_is_synced_with_the_rest() -> None:
    a, b = run_ranks(_unfrozen, 2, timeout=TIMEOUT)
    assert torch.equal(a, b)  # step 2H is a sync: the first layer too


def _every_rank_raises(body, world: int, text: str) -> None:
    """``body`` on ``world`` ranks raises on every one of them, each message holding ``text``."""
    with pytest.raises(RankError) as caught:
        run_ranks(body, world, timeout=60)
    for message in caught.value.messages:
        assert message is not None
        assert text in message


def _uneven(backend, steps: tuple[int, int], kw: dict):
    """Rank r takes ``steps[r]`` inner steps (it runs out of data), then calls ``finish()``."""
    model = _model()
    opt = commopt.DiLoCo(torch.optim.Adam(model.parameters(), lr=1e-2), sync_every=H, **kw)
    for step in range(1, steps[backend.rank] + 1):
        _loss(model, backend.rank, step).backward()
        opt.step()
        opt.zero_grad()
    opt.finish()


@pytest.mark.parametrize(
    "steps, kw, seen",
    [
        ((2 * H + 1, 2 * H), {}, (2 * H + 1, 2 * H)),  # both in finish()
        ((2 * H, 2 * H - 2), {}, (2 * H, 2 * H - 2)),  # rank 0 in the sync after step 2H
        ((2 * H, 2 * H - 2), {"fragments": 2, "delay": 1}, (2 * H, 2 * H - 2)),  # sync on a thread
        ((2 * H, 2 * H - 2), {"warmup_steps": 3 * H}, (2 * H - 1, 2 * H - 2)),  # in the warmup
    ],
    ids=["finish", "sync", "delayed-sync", "warmup"],
)
def test_ranks_out_of_step_get_a_clear_error_on_every_rank_not_a_hang(steps, kw, seen) -> None:
    """A rank that ran out of data calls ``finish()`` while the others are still training: in
    ``finish()`` too, in a sync, or in the warmup's averaging. Each of these begins with the
    same step check, so every rank raises, naming each rank's step. A sync used to start its
    exchange against the other rank's check: gloo aborted the process ("Is there a distributed
    collective mismatch?"), and NCCL would wait for ever."""
    expected = f"took different numbers of inner steps (rank 0 {seen[0]}, rank 1 {seen[1]})"
    _every_rank_raises(functools.partial(_uneven, steps=steps, kw=kw), 2, expected)


def _batchnorm(backend, with_buffers: bool, extra_on_rank_1: bool = False):
    """A model with BatchNorm, and a constant buffer, trained on each rank's own data (H = 3,
    7 steps, so the last step is not a sync): (its buffers by name before and after
    ``finish``, the bytes its syncs sent)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    )
    model.register_buffer("constant", torch.rand(100, generator=torch.Generator().manual_seed(0)))
    opt = commopt.DiLoCo(torch.optim.Adam(model.parameters(), lr=1e-2), sync_every=3)
    for step in range(1, 8):
        _loss(model, backend.rank, step).backward()
        opt.step()
        opt.zero_grad()
    before = {k: b.clone() for k, b in model.named_buffers()}
    buffers = list(model.buffers()) if with_buffers else []
    if extra_on_rank_1 and backend.rank == 1:
        buffers.append(torch.zeros(2))
    opt.finish(buffers)
    after = {k: b.clone() for k, b in model.named_buffers()}
    return before, after, opt.comm_stats()["sync_bytes"]


def test_finish_averages_the_buffers_it_is_given_so_the_ranks_end_with_one_model() -> None:
    """DiLoCo syncs parameters; BatchNorm's running statistics follow each rank's data. Given
    ``model.buffers()``, ``finish`` averages the floating-point ones (the counter is the same
    on every rank already; a buffer equal on every rank stays bit for bit what it was, which
    an fp32 mean of three does not); without them each rank keeps its own and nothing more is
    sent."""
    world = 3
    averaged = run_ranks(_batchnorm, world, True, timeout=TIMEOUT)
    kept = run_ranks(_batchnorm, world, False, timeout=TIMEOUT)
    stats = ["1.running_mean", "1.running_var"]
    for name in stats:
        mean = sum(before[name].double() for before, _, _ in averaged) / world
        assert all(torch.equal(after[name], mean.float()) for _, after, _ in averaged)
        assert not all(torch.equal(kept[0][1][name], after[name]) for _, after, _ in kept)
    for name in ["constant", "1.num_batches_tracked"]:  # equal on every rank: left as it was
        assert all(torch.equal(after[name], before[name]) for before, after, _ in averaged)
    assert all(a[2] > k[2] for a, k in zip(averaged, kept, strict=True))
    pairs = zip(averaged, kept, strict=True)  # both runs trained alike up to finish()
    assert all(torch.equal(a[0][k], b[0][k]) for a, b in pairs for k in a[0])


def _other_buffers(backend):
    _batchnorm(backend, True, extra_on_rank_1=True)


def test_finish_with_other_buffers_on_some_rank_is_a_clear_error_not_a_hang() -> None:
    _every_rank_raises(_other_buffers, 2, "passed floating-point buffers of different sizes")


def _nan_everywhere(backend):
    model = _model()
    opt = commopt.DiLoCo(torch.optim.Adam(model.parameters(), lr=1e-2), sync_every=2)
    _loss(model, backend.rank, 1).backward()
    opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # every rank the same NaNs, as an fp16 model's overflow gives
    _loss(model, backend.rank, 2).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            opt.step()
        except commopt.NonFiniteError as err:
            return str(err), [str(w.message) for w in caught]
    return None, []


def test_identical_nans_at_the_first_sync_raise_without_a_lockstep_warning() -> None:
    for message, warned in run_ranks(_nan_everywhere, 2, timeout=TIMEOUT):
        assert message is not None and "rank(s) [0, 1]" in message
        assert not any("lockstep" in w for w in warned), warned


def _disagree(backend):
    model = _model()
    every = 10 if backend.rank == 2 else 20
    commopt.DiLoCo(torch.optim.Adam(model.parameters()), sync_every=every)


def test_ranks_built_with_other_settings_get_a_clear_error_not_a_hang() -> None:
    _every_rank_raises(_disagree, 3, "sync_every: rank 0 20, rank 1 20, rank 2 10")


def _rank0_weights(backend):
    torch.manual_seed(backend.rank)
    model = (
        _model()
        if backend.rank == 0
        else torch.nn.Sequential(torch.nn.Linear(6, 20), torch.nn.Tanh(), torch.nn.Linear(20, 3))
    )
    commopt.DiLoCo(torch.optim.Adam(model.parameters()), sync_every=4)
    return _flat(model)


def test_every_rank_starts_from_rank_0s_weights() -> None:
    results = run_ranks(_rank0_weights, 3, timeout=TIMEOUT)
    assert all(torch.equal(r, _flat(_model())) for r in results)


def _files(backend, path, delay):
    def build():
        model = _model()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        kw = dict(sync_every=4, fragments=2, delay=delay, fp32_syncs=0)  # error buffers in play
        return model, commopt.DiLoCo(inner, **kw)

    def train(model, opt, steps):
        for step in steps:
            _loss(model, backend.rank, step).backward()
            opt.step()
            opt.zero_grad()

    model, opt = build()
    train(model, opt, range(1, 17))
    opt.finish()
    whole = _flat(model)
    model, opt = build()
    train(model, opt, range(1, 8))  # fragment 1 synced at 4, fragment 0 at 6: mid-interval
    commopt.save_checkpoint(path, model, opt, step=7)
    model, opt = build()
    extra = commopt.load_checkpoint(path, model, opt)
    train(model, opt, range(extra["step"] + 1, 17))
    opt.finish()
    return torch.equal(_flat(model), whole)


@pytest.mark.parametrize("delay", [0, 1])
def test_a_resume_from_checkpoint_files_mid_interval_is_bit_exact(tmp_path, delay) -> None:
    assert all(run_ranks(_files, 2, str(tmp_path / "ckpt"), delay, timeout=TIMEOUT))


def _other_world(backend, path):
    model = _model()
    opt = commopt.DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=4, fp32_syncs=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        commopt.load_checkpoint(path, model, opt)
    errors_zero = all(bool((b == 0).all()) for f in opt.parts for s in f.states for b in s.values())
    return errors_zero, any("error buffers are reset to zero" in str(w.message) for w in caught)


def _trained(backend):
    """9 steps at H = 4, 1 bit from the first sync: error buffers in play, mid-interval."""
    model = _model()
    opt = commopt.DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=4, fp32_syncs=0)
    for step in range(1, 10):
        _loss(model, backend.rank, step).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _save(backend, path):
    commopt.save_checkpoint(path, *_trained(backend))


def test_a_checkpoint_loads_at_another_world_size_with_zero_error_buffers(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    run_ranks(_save, 4, path, timeout=TIMEOUT)
    for errors_zero, warned in run_ranks(_other_world, 2, path, timeout=TIMEOUT):
        assert errors_zero and warned


def _rank0s_file_everywhere(backend):
    """What a one-file checkpoint does (HF Trainer saves rank 0's optimizer state): every rank
    loads rank 0's state dict."""
    _, opt = _trained(backend)
    saved = [opt.state_dict()]
    torch.distributed.broadcast_object_list(saved, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(saved[0])
    errors = [b for f in opt.parts for s in f.states for b in s.values()]
    warned = [str(w.message) for w in caught if "saved by rank 0" in str(w.message)]
    return all(bool((b == 0).all()) for b in errors), bool(warned)


def test_rank_0s_state_dict_loaded_everywhere_resets_the_other_ranks_error_buffers() -> None:
    """Never another rank's error buffers: rank r's worker error is its own, and its server
    error is for its own chunk. Rank 0 restores its own; the others get zeros and a warning."""
    results = run_ranks(_rank0s_file_everywhere, 3, timeout=TIMEOUT)
    assert results[0] == (False, False)
    assert results[1:] == [(True, True), (True, True)]


def _under_ddp(backend, wrap):
    """DiLoCo over a model that is plain, DDP-wrapped, or DDP-wrapped with torch's noop_hook:
    (warned of lockstep, parameters differed across ranks before the first sync, final bits)."""
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
    from torch.nn.parallel import DistributedDataParallel

    plain = _model()
    model = plain if wrap == "plain" else DistributedDataParallel(plain, broadcast_buffers=False)
    if wrap == "ddp+noop_hook":
        model.register_comm_hook(None, noop_hook)
    opt = commopt.DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=H)
    differed = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 3 * H + 1):
            _loss(model, backend.rank, step).backward()
            opt.step()
            opt.zero_grad()
            if step == H - 1:
                everyone = torch.empty(backend.world_size * _flat(plain).numel())
                backend.all_gather(everyone, _flat(plain))
                rows = everyone.view(backend.world_size, -1)
                differed = not all(torch.equal(rows[0], row) for row in rows)
    warned = any("ran in lockstep" in str(w.message) for w in caught)
    return warned, differed, _flat(plain)


def test_under_ddp_the_lockstep_is_warned_of_and_noop_hook_gives_the_plain_bits() -> None:
    """A DDP model averages every gradient in backward, which turns the inner steps into
    data-parallel ones: DiLoCo says so at the first sync, on every rank. With torch's noop_hook
    the gradients stay local and DiLoCo computes exactly what it does without DDP."""
    plain = run_ranks(_under_ddp, 3, "plain", timeout=TIMEOUT)
    ddp = run_ranks(_under_ddp, 3, "ddp", timeout=TIMEOUT)
    local = run_ranks(_under_ddp, 3, "ddp+noop_hook", timeout=TIMEOUT)
    assert [(w, d) for w, d, _ in plain] == [(False, True)] * 3
    assert [(w, d) for w, d, _ in ddp] == [(True, False)] * 3
    assert [(w, d) for w, d, _ in local] == [(False, True)] * 3
    assert all(torch.equal(a[2], b[2]) for a, b in zip(plain, local, strict=True))
    assert all(torch.equal(plain[0][2], r[2]) for r in plain)  # one model after the last sync


def _compiled(backend, how: str):
    """12 steps of DiLoCo over Adam (H = 4, two fragments each applied a step late, two
    warmup steps) with ``torch.compile(opt.step)`` (``how="step"``) or with the inner
    optimizer's step alone compiled (``"inner"``); the final parameters."""
    model = _model()
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    if how == "inner":
        inner.step = torch.compile(inner.step)
    opt = commopt.DiLoCo(inner, sync_every=4, fragments=2, delay=1, warmup_steps=2, backend=backend)
    step = torch.compile(opt.step) if how == "step" else opt.step
    for t in range(1, 13):
        _loss(model, backend.rank, t).backward()
        step()
        opt.zero_grad()
    opt.finish()
    return _flat(model)


def test_torch_compile_of_step_compiles_the_inner_step_and_runs_the_syncs_as_they_are() -> None:
    """``torch.compile(opt.step)`` compiles what it would compile of the inner optimizer's own
    step, and the warmup's averaging, the syncs and the outer step run eagerly: the same bits as
    DiLoCo over a compiled inner step (inductor's Adam is not bit for bit eager Adam, so that is
    the reference). Dynamo used to trace the syncs too, and inductor's outer step moved the
    bits."""
    compiled = run_ranks(_compiled, 2, "step", timeout=TIMEOUT)
    reference = run_ranks(_compiled, 2, "inner", timeout=TIMEOUT)
    assert all(torch.equal(a, b) for a, b in zip(compiled, reference, strict=True))
    assert torch.equal(compiled[0], compiled[1])


def _sparse_embedding(backend, how: str):
    """An ``nn.Embedding(sparse=True)`` trained by SparseAdam, each rank on its own rows: under
    DiLoCo with 3 warmup steps and H = 2 (``how="diloco"``), or as DDP for 3 steps (``"ddp"``,
    whose sparse all-reduce is the reference for the warmup). The weights after step 3, and
    after step 7 (with ``finish()``, DiLoCo only)."""
    torch.manual_seed(0)
    plain = torch.nn.Embedding(12, 3, sparse=True)
    if how == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(plain)
        opt = torch.optim.SparseAdam(model.parameters(), lr=0.1)
    else:
        model = plain
        inner = torch.optim.SparseAdam(model.parameters(), lr=0.1)
        opt = commopt.DiLoCo(inner, sync_every=2, warmup_steps=3, backend=backend)
    seen = []
    for step in range(1, 8 if how == "diloco" else 4):
        g = torch.Generator().manual_seed(100 * step + backend.rank)
        rows = torch.randint(4 * backend.rank, 4 * backend.rank + 6, (5,), generator=g)
        model(rows).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 3:
            seen.append(plain.weight.detach().clone())
    if how == "diloco":
        opt.finish()
        seen.append(plain.weight.detach().clone())
    return seen


def test_sparse_gradients_are_averaged_in_warmup_as_ddp_averages_them() -> None:
    """The warmup averages an embedding's sparse gradients over the union of the ranks' rows,
    as DDP's sparse all-reduce does: SparseAdam then steps the same rows with the same values,
    bit for bit. (The averaging used to fail on sparse gradients: ``reshape is not implemented
    for sparse tensors``.) After the warmup the syncs keep the replicas identical."""
    diloco = run_ranks(_sparse_embedding, 2, "diloco", timeout=TIMEOUT)
    ddp = run_ranks(_sparse_embedding, 2, "ddp", timeout=TIMEOUT)
    assert all(torch.equal(d[0], r[0]) for d, r in zip(diloco, ddp, strict=True))
    assert torch.equal(diloco[0][1], diloco[1][1])
    assert not torch.equal(diloco[0][0], diloco[0][1])  # the run went on after the warmup


class _Branches(torch.nn.Module):
    """A trunk, a head that rank 1 uses only at odd steps, and a head no rank ever uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.head, self.unused = (torch.nn.Linear(6, 3) for _ in range(3))

    def forward(self, x: torch.Tensor, use_head: bool) -> torch.Tensor:
        y = self.trunk(x)
        return y + self.head(x) if use_head else y


def _unused_parameters(backend, how: str):
    """3 steps of Adam as DiLoCo's warmup (``how="diloco"``) or under DDP with
    ``find_unused_parameters=True``; the parameters after them, and whether the never-used
    head has a gradient."""
    plain = _Branches()
    model = plain
    if how == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(plain, find_unused_parameters=True)
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt = inner if how == "ddp" else commopt.DiLoCo(inner, sync_every=2, warmup_steps=3)
    for step in range(1, 4):
        g = torch.Generator().manual_seed(10 * step + backend.rank)
        x = torch.randn(8, 6, generator=g)
        model(x, backend.rank == 0 or step % 2 == 1).square().mean().backward()
        opt.step()
        if step < 3:
            opt.zero_grad()
    return [p.detach().clone() for p in plain.parameters()], plain.unused.weight.grad is None


def test_a_gradient_missing_on_some_ranks_is_averaged_as_zero_as_ddp_averages_it() -> None:
    """A head that one rank's batch did not use (a branch, an expert) has no gradient there:
    the warmup averages it as zero, and every rank steps it with the mean, bit for bit DDP with
    ``find_unused_parameters=True``; a head no rank used gets no gradient and no step. (The
    averaging used to refuse it: "gradients for different numbers of parameters".)"""
    diloco = run_ranks(_unused_parameters, 2, "diloco", timeout=TIMEOUT)
    ddp = run_ranks(_unused_parameters, 2, "ddp", timeout=TIMEOUT)
    for (ours, our_none), (theirs, their_none) in zip(diloco, ddp, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        assert our_none and their_none
    assert all(torch.equal(a, b) for a, b in zip(diloco[0][0], diloco[1][0], strict=True))


def _finish_in_flight(backend, on_subgroup: bool):
    """DiLoCo with a delayed sync (H = 4, τ = 1) whose last step starts a sync, then
    ``finish()``: over the default group (the sync on a channel of its own) or over a process
    group of the same ranks (a sub-group: no channel, as FSDP2's replicate group)."""
    if on_subgroup:
        backend = commopt.TorchBackend(torch.distributed.new_group([0, 1]))
    model = _model()
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt = commopt.DiLoCo(inner, sync_every=4, delay=1, compression="none", backend=backend)
    for step in range(1, 9):
        _loss(model, backend.rank, step).backward()
        opt.step()
        opt.zero_grad()
    opt.finish()
    return opt._channel != "", _flat(model)


def test_finish_with_a_sync_in_flight_on_a_backend_without_a_channel() -> None:
    """On a backend that cannot open a channel the delayed sync shares the main communicator;
    ``finish()`` now completes it before its own step check. It used to check first, and
    where a rank issued the check before the thread's all-reduce the two paired with each
    other: a gloo abort, a hang, or a step count of garbage (a race: the old code failed here
    in about one run in three)."""
    channel = run_ranks(_finish_in_flight, 2, False, timeout=TIMEOUT)
    shared = run_ranks(_finish_in_flight, 2, True, timeout=TIMEOUT)
    assert [c for c, _ in channel] == [True, True] and [c for c, _ in shared] == [False, False]
    assert torch.equal(shared[0][1], shared[1][1])
    assert all(torch.equal(a[1], b[1]) for a, b in zip(channel, shared, strict=True))
