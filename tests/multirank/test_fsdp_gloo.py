"""commopt's optimizers on FSDP2 shards (``commopt.fsdp``), on forked gloo ranks.

R replicas × S shards is the data-parallel computation of ``topology="hierarchical"`` with nodes
of S ranks: full precision inside a shard group, one bit between replicas. With S = 1 it is the
flat optimizer. Why the 2 × 2 comparison is close but not bit for bit: FSDP2 averages the
gradient inside the shard group (reduce-scatter) before the momentum fold, the hierarchical
exchange averages the momentum after it (the same by linearity, in another rounding order), and
the warmup's average is a reduce-scatter then an all-reduce instead of one all-reduce; 1-bit
LAMB's norms are sums of shard norms. Hence ≤ 1e-6 relative (to the largest parameter) per step
taken. 0/1 Adam's local steps differ by design: a replica steps on its shard group's mean
gradient, where a hierarchical rank steps on its own, so the comparison ends at its first local
step.
"""

from __future__ import annotations

import itertools
import math
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.distributed.tensor import DTensor

from tests.multirank.harness import run_ranks
from tests.optim_registry import BY_NAME, OPTIMIZERS

TIMEOUT = 240.0
STEPS = 20
D = 32


def _mlp(widths: tuple[int, ...] = (D, D, D, D), bias: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers += [nn.Tanh()] if i else []
        layers.append(nn.Linear(a, b, bias=bias))
    return nn.Sequential(*layers)


def _sharded(model: nn.Module, replicas: int, shards: int, **kw):
    """``model`` sharded by FSDP2 over ``mesh["shard"]``, each Linear and then the whole
    (``kw``: more of ``fully_shard``'s arguments, as ``mp_policy``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["shard"], **kw)
    fully_shard(model, mesh=mesh["shard"], **kw)
    return model, mesh


def _batch(step: int, width: int = D, out: int = D) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(8, width, generator=g), torch.randn(8, out, generator=g)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x, y = _batch(step, model[0].in_features, model[-1].out_features)
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


def _gathered(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _same_across_replicas(model: nn.Module, sharding) -> bool:
    """Every shard bit-identical on the R ranks holding it (one all-reduce of flags)."""
    local = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(local) for _ in range(sharding.replicate.world_size)]
    dist.all_gather(gathered, local, group=sharding.replicate.group)
    return all(torch.equal(g, local) for g in gathered)


def _against_reference(backend, shards: int):
    """Each optimizer, sharded S ways on 4 // S replicas, against the same optimizer on whole
    parameters (hierarchical with nodes of S ranks; flat when S = 1), step by step."""
    import commopt.fsdp

    del backend
    rank, replicas = dist.get_rank(), 4 // shards
    os.environ.update(LOCAL_RANK=str(rank % shards), LOCAL_WORLD_SIZE=str(shards))
    os.environ.update(GROUP_RANK=str(rank // shards))
    out = {}
    for info in OPTIMIZERS:
        ref = _mlp()
        mode = "hierarchical" if shards > 1 else "standalone"
        # one parameter per bucket on both sides, so a rank's hierarchical slice is its shard
        ref_opt = info.make(list(ref.parameters()), mode=mode, backward=True, bucket_numel=D * D)
        model, mesh = _sharded(_mlp(), replicas, shards)
        opt = info.make(list(model.parameters()), backward=True, bucket_numel=D * D // shards)
        sharding = commopt.fsdp.attach(model, opt, mesh)
        diffs, replicas_equal = [], []
        for step in range(1, STEPS + 1):
            _train_step(ref, ref_opt, step)
            _train_step(model, opt, step)
            whole = [p.detach() for p in ref.parameters()]
            top = max(float(w.abs().max()) for w in whole)
            diffs.append(
                max(
                    float((w - s).abs().max()) for w, s in zip(whole, _gathered(model), strict=True)
                )
                / top
            )
            replicas_equal.append(_same_across_replicas(model, sharding))
        stats = opt.comm_stats()
        out[info.name] = (diffs, replicas_equal, opt.exchange.name, stats["compressed_rounds"])
    return out


def _first_local_step(info) -> float:
    return min(
        (s for ph in info.phases(STEPS, backward=True) if not ph.communicates for s in ph.steps),
        default=math.inf,
    )


@pytest.fixture(scope="module")
def two_by_two():
    return run_ranks(_against_reference, 4, 2, timeout=TIMEOUT)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_two_by_two_equals_hierarchical_within_rounding(two_by_two, info) -> None:
    first_local = _first_local_step(info)
    for rank, result in enumerate(two_by_two):
        diffs, replicas_equal, name, compressed = result[info.name]
        assert name == f"sharded:2x2:{rank // 2}.{rank % 2}"
        assert compressed > 0
        for step, diff in enumerate(diffs, 1):
            if step < first_local:
                assert diff <= 1e-6 * step, (rank, step, diffs)
        phases = info.phases(STEPS, backward=True)
        communicating = {s for ph in phases if ph.communicates for s in ph.steps}
        for step, equal in enumerate(replicas_equal, 1):
            if step in communicating:
                assert equal, f"replicas differ after step {step} on rank {rank}"


@pytest.fixture(scope="module")
def four_by_one():
    return run_ranks(_against_reference, 4, 1, timeout=TIMEOUT)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_one_shard_per_replica_is_the_flat_optimizer_bit_for_bit(four_by_one, info) -> None:
    # Bit for bit: S = 1 has no reduce-scatter to reorder, and the replicate group holds
    # the ranks of the flat exchange in the same order.
    for rank, result in enumerate(four_by_one):
        diffs, _, name, _ = result[info.name]
        assert name == f"sharded:4x1:{rank}.0"
        assert diffs == [0.0] * STEPS


def _resume(backend, name: str, path: str):
    """Save at step 4, then: go on; load at the same mesh and go on; load at 4 × 1."""
    import commopt.fsdp

    del backend
    info = BY_NAME[name]

    def build(replicas, shards):
        model, mesh = _sharded(_mlp((D, D, D), bias=True), replicas, shards)
        opt = info.make(list(model.parameters()), backward=True)
        commopt.fsdp.attach(model, opt, mesh)
        return model, opt

    def moments(opt):
        sd = commopt.fsdp.optimizer_state_dict(opt)["state"]
        values = [v for i in sorted(sd) for _, v in sorted(sd[i].items())]
        return [v.full_tensor() if isinstance(v, DTensor) else v.clone() for v in values]

    model, opt = build(2, 2)
    for step in range(1, 5):
        _train_step(model, opt, step)
    commopt.fsdp.save_checkpoint(path, model, opt)
    saved = _gathered(model), moments(opt), dict(opt.global_state)
    for step in range(5, 9):
        _train_step(model, opt, step)
    straight = _gathered(model)

    model2, opt2 = build(2, 2)
    commopt.fsdp.load_checkpoint(path, model2, opt2)
    for step in range(5, 9):
        _train_step(model2, opt2, step)
    resumed = _gathered(model2)

    model3, opt3 = build(4, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        commopt.fsdp.load_checkpoint(path, model3, opt3)
    resharded = _gathered(model3), moments(opt3), dict(opt3.global_state)
    messages = [str(w.message) for w in caught if "exchange buffers" in str(w.message)]
    return saved, straight, resumed, resharded, messages


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_dcp_resume_is_bit_exact_and_reshards_the_moments(info) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_resume, 4, info.name, os.path.join(tmp, "ckpt"), timeout=TIMEOUT)
    for saved, straight, resumed, resharded, messages in results:
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))
        (params, moments, schedule), (params2, moments2, schedule2) = saved, resharded
        assert all(torch.equal(a, b) for a, b in zip(params, params2, strict=True))
        assert len(moments) == len(moments2)
        assert all(torch.equal(a, b) for a, b in zip(moments, moments2, strict=True))
        assert schedule == schedule2
        assert len(messages) == 1 and "start from zero" in messages[0]


def _resume_between_syncs(backend, path):
    """0/1 Adam saved at its first local step, when the replicas' shards differ: (the replicas
    differed at the save, the resumed run equals the straight one bit for bit)."""
    import commopt.fsdp

    del backend
    info = BY_NAME["ZeroOneAdam"]
    local = [s for ph in info.phases(STEPS, backward=True) if not ph.communicates for s in ph.steps]
    k = min(local)

    def build():
        model, mesh = _sharded(_mlp((D, D, D), bias=True), 2, 2)
        opt = info.make(list(model.parameters()), backward=True)
        return model, opt, commopt.fsdp.attach(model, opt, mesh)

    model, opt, sharding = build()
    for step in range(1, k + 1):
        _train_step(model, opt, step)
    differed = not _same_across_replicas(model, sharding)
    commopt.fsdp.save_checkpoint(path, model, opt)
    for step in range(k + 1, STEPS + 1):
        _train_step(model, opt, step)
    straight = _gathered(model)
    model, opt, _ = build()
    commopt.fsdp.load_checkpoint(path, model, opt)
    for step in range(k + 1, STEPS + 1):
        _train_step(model, opt, step)
    return differed, all(torch.equal(a, b) for a, b in zip(straight, _gathered(model), strict=True))


def test_dcp_resume_between_zero_one_adam_syncs_is_bit_exact() -> None:
    """Between 0/1 Adam's syncs each replica's shards are its own; DCP keeps one copy of what it
    takes for replicated shards, so commopt.fsdp writes each replica's apart (it resumed every
    replica from one replica's copy before)."""
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_resume_between_syncs, 4, os.path.join(tmp, "ckpt"), timeout=TIMEOUT)
    assert results == [(True, True)] * 4


def _ragged(backend, name: str, overrides: dict):
    """Shards of unequal length, and empty ones (a 1-row weight on 2 shards), in buckets capped
    at 200 elements; attached without the mesh."""
    import commopt.fsdp

    del backend
    model, _ = _sharded(_mlp((D, 31, 1), bias=True), 2, 2)
    opt = BY_NAME[name].make(list(model.parameters()), backward=True, **overrides)
    sharding = commopt.fsdp.attach(model, opt)  # (no mesh: the replicate groups are found)
    before = _gathered(model)
    equal = []
    for step in range(1, 13):
        _train_step(model, opt, step)
        equal.append(_same_across_replicas(model, sharding))
    moved = all(not torch.equal(a, b) for a, b in zip(before, _gathered(model), strict=True))
    scalars = [  # per-tensor state (1-bit LAMB's factors and coefficients): whole-tensor values
        (k, v.clone()) for p in model.parameters() for k, v in opt.state[p].items() if v.dim() == 0
    ]
    return equal, moved, scalars, len(opt.flat_states), (opt.frozen_after(), opt.global_state)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_uneven_and_empty_shards_train_with_identical_replicas(info) -> None:
    phases = info.phases(12, backward=True)
    communicating = {s for ph in phases if ph.communicates for s in ph.steps}
    results = run_ranks(_ragged, 4, info.name, {"bucket_numel": 200}, timeout=TIMEOUT)
    for equal, moved, scalars, buckets, _ in results:
        assert moved
        assert all(e for step, e in enumerate(equal, 1) if step in communicating)
        # every shard rank laid out the same buckets and holds the same per-tensor values
        assert buckets == results[0][3] > 1
        assert [k for k, _ in scalars] == [k for k, _ in results[0][2]]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(scalars, results[0][2], strict=True))


def test_automatic_freeze_decides_alike_on_every_shard() -> None:
    # The variance level sums each tensor over its shards: shard ranks freeze at one step.
    from commopt.optim.freeze import AutoFreezeSettings

    info = BY_NAME["OnebitAdam"]
    auto = {"freeze_step": AutoFreezeSettings(min_step=3, max_step=11, threshold=0.5)}
    results = run_ranks(_ragged, 4, info.name, auto, timeout=TIMEOUT)
    frozen, schedule = results[0][4]
    assert frozen < 11  # decided by the level, not by max_step
    assert all(r[4] == (frozen, schedule) for r in results)  # levels recorded alike


def _state_bytes(backend, shards: int) -> int:
    """This rank's optimizer state (every state tensor and exchange buffer), in bytes."""
    import commopt.fsdp

    del backend
    model, mesh = _sharded(_mlp((64, 64, 64, 64)), dist.get_world_size() // shards, shards)
    opt = BY_NAME["OnebitAdam"].make(list(model.parameters()))
    commopt.fsdp.attach(model, opt, mesh)
    _train_step(model, opt, 1)
    storages = {}
    for state in opt.flat_states:
        for t in [*state.flat.values(), *state.comm.values()]:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def test_state_per_rank_is_divided_by_the_shard_count() -> None:
    whole = run_ranks(_state_bytes, 2, 1, timeout=TIMEOUT)  # 2 replicas × 1 shard
    halves = run_ranks(_state_bytes, 4, 2, timeout=TIMEOUT)  # 2 replicas × 2 shards
    assert len(set(whole)) == 1
    for nbytes in halves:
        assert nbytes <= 1.05 * whole[0] / 2


def _refusals(backend):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import commopt
    import commopt.fsdp

    del backend
    errors = {}

    def attempt(key, fn):
        try:
            fn()
        except (TypeError, ValueError) as e:
            errors[key] = (type(e).__name__, str(e))

    plain = _mlp()
    attempt("not fsdp", lambda: commopt.fsdp.attach(plain, commopt.OnebitAdam(plain.parameters())))
    model, mesh = _sharded(_mlp(), 2, 2)
    attempt(
        "torch optimizer", lambda: commopt.fsdp.attach(model, torch.optim.AdamW(model.parameters()))
    )
    attempt(
        "hierarchical",
        lambda: commopt.fsdp.attach(
            model, commopt.OnebitAdam(model.parameters(), topology="hierarchical"), mesh
        ),
    )
    attempt(
        "overlap",
        lambda: commopt.fsdp.attach(
            model, commopt.OnebitAdam(model.parameters(), overlap=True), mesh
        ),
    )
    attached = commopt.OnebitAdam(model.parameters())
    commopt.fsdp.attach(model, attached, mesh)
    try:
        commopt.save_checkpoint(tempfile.mkdtemp(), model, attached)
    except commopt.CheckpointError as e:
        errors["commopt checkpoint"] = ("CheckpointError", str(e))
    unattached = commopt.OnebitAdam(model.parameters())
    attempt("unattached", lambda: _train_step(model, unattached, 1))
    unattached.zero_grad()
    stepped = commopt.OnebitAdam(model.parameters())
    commopt.fsdp.attach(model, stepped, mesh)
    _train_step(model, stepped, 1)
    attempt("stepped", lambda: commopt.fsdp.attach(model, stepped, mesh))

    native = _mlp()
    for layer in native:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(native, mesh=mesh)
    attempt(
        "native hsdp", lambda: commopt.fsdp.attach(native, commopt.OnebitAdam(native.parameters()))
    )
    # groups added after attach: a whole parameter, or one sharded over another mesh
    whole = nn.Parameter(torch.ones(3))
    attempt("whole group", lambda: attached.add_param_group({"params": [whole]}))
    elsewhere = next(native.parameters())
    attempt("other mesh group", lambda: attached.add_param_group({"params": [elsewhere]}))
    errors["groups kept"] = ("count", str(len(attached.param_groups)))
    attempt("join", lambda: Join([attached]))

    flat_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("shard",))
    pure = _mlp()
    for layer in pure:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=flat_mesh)
    fully_shard(pure, mesh=flat_mesh)
    attempt("pure fsdp", lambda: commopt.fsdp.attach(pure, commopt.OnebitAdam(pure.parameters())))
    return errors


def test_clear_errors() -> None:
    errors = run_ranks(_refusals, 4, timeout=TIMEOUT)[0]
    expected = {
        "not fsdp": ("TypeError", "not FSDP2-wrapped"),
        "torch optimizer": ("TypeError", "needs a commopt optimizer"),
        "hierarchical": ("ValueError", "leave topology='flat'"),
        "overlap": ("ValueError", "during backward"),
        "stepped": ("ValueError", "attach before the first step"),
        "unattached": ("ValueError", "call commopt.fsdp.attach(model, optimizer, mesh)"),
        "native hsdp": ("ValueError", "native HSDP"),
        "pure fsdp": ("ValueError", "nothing to average at one bit"),
        "commopt checkpoint": ("CheckpointError", "commopt.fsdp.save_checkpoint"),
        "whole group": ("ValueError", "is not sharded (not a DTensor)"),
        "other mesh group": ("ValueError", "shard every module over the same mesh['shard']"),
        "groups kept": ("count", "1"),
        "join": ("ValueError", "FSDP2 is no joinable"),
    }
    assert set(errors) == set(expected), errors
    for key, (kind, text) in expected.items():
        assert errors[key][0] == kind and text in errors[key][1], (key, errors[key])


SCALER_FREEZE, SCALER_CALLS = 3, 10
SCALER_INF = {2: 0, 6: 3}  # step → the rank whose shard overflows: in warmup, then compressed


def _scaled(backend, name: str, use_scaler: bool):
    """SCALER_CALLS steps on 2 × 2; with ``use_scaler`` through GradScaler with an inf where
    SCALER_INF says, else plain, every rank's gradients dropped at those steps (the reference:
    a step without gradients is no step)."""
    import commopt.fsdp

    del backend
    warnings.simplefilter("ignore")  # the skip's warning
    rank = dist.get_rank()
    model, mesh = _sharded(_mlp(), 2, 2)
    opt = BY_NAME[name].make(list(model.parameters()), freeze=SCALER_FREEZE)
    sharding = commopt.fsdp.attach(model, opt, mesh)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # a power of 2: exact unscaling
    for step in range(1, SCALER_CALLS + 1):
        x, y = _batch(step)
        loss = ((model(x) - y) ** 2).mean()
        if use_scaler:
            scaler.scale(loss).backward()
            if SCALER_INF.get(step) == rank:
                next(model.parameters()).grad.to_local()[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            if step in SCALER_INF:
                opt.zero_grad()
            opt.step()
        opt.zero_grad()
    local = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
    skipped = opt.comm_stats()["skipped_steps"]
    return local, skipped, scaler.get_scale(), _same_across_replicas(model, sharding)


@pytest.mark.parametrize("name", list(BY_NAME))
def test_grad_scaler_with_an_inf_in_one_shard_skips_the_step_on_every_rank(name) -> None:
    """An overflow in one rank's shard, once in warmup and once in the compression stage: every
    rank skips the step (commopt agrees on non-finite gradients over the whole mesh), bit for
    bit the run that dropped those steps; the replicas stay identical, and each rank's scale
    backs off where GradScaler saw the inf (its shard group)."""
    scaled = run_ranks(_scaled, 4, name, True, timeout=TIMEOUT)
    plain = run_ranks(_scaled, 4, name, False, timeout=TIMEOUT)
    taken = SCALER_CALLS - len(SCALER_INF)
    assert BY_NAME[name].communicates(taken, SCALER_FREEZE)  # so the replicas agree at the end
    for rank, ((local, skipped, scale, same), (expected, *_)) in enumerate(
        zip(scaled, plain, strict=True)
    ):
        assert torch.equal(local, expected), rank
        assert skipped == len(SCALER_INF), (rank, skipped)
        group = {r // 2 for r in SCALER_INF.values()}  # the shard groups that saw an inf
        assert scale == (2.0**9 if rank // 2 in group else 2.0**10), (rank, scale)
        assert same, rank


MP_STEPS = 12


def _bf16_compute(backend, name: str, reduce_dtype: torch.dtype | None, policy: bool):
    """MP_STEPS steps on 2 × 2 of ``name``; with ``policy``, FSDP2's
    ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)`` on every
    module, the way docs/fsdp.md tells users to compute in low precision."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import commopt.fsdp

    del backend
    kw = {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, reduce_dtype)} if policy else {}
    model, mesh = _sharded(_mlp(bias=True), 2, 2, **kw)
    opt = BY_NAME[name].make(list(model.parameters()), freeze=4)
    sharding = commopt.fsdp.attach(model, opt, mesh)
    start = torch.cat([w.reshape(-1) for w in _gathered(model)])
    losses, equal, dtypes = [], [], set()
    for step in range(1, MP_STEPS + 1):
        x, y = _batch(step)
        out = model(x)
        dtypes.add(out.dtype)
        loss = ((out.float() - y) ** 2).mean()
        loss.backward()
        dtypes.update(p.grad.dtype for p in model.parameters())
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        equal.append(_same_across_replicas(model, sharding))
    dtypes.update(p.dtype for p in model.parameters())
    dtypes.update(v.dtype for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    moved = torch.cat([w.reshape(-1) for w in _gathered(model)]) - start
    return losses, equal, dtypes, opt.comm_stats()["compressed_rounds"], moved


@pytest.mark.parametrize("reduce_dtype", [torch.float32, None], ids=["reduce-fp32", "reduce-bf16"])
@pytest.mark.parametrize("name", list(BY_NAME))
def test_bf16_compute_through_fsdp2s_mixed_precision_policy(name, reduce_dtype) -> None:
    """docs/fsdp.md's answer to low precision (the sharded parameters stay fp32, FSDP2 computes
    in bf16): it trains through the warmup and the 1-bit stage, the parameters, gradients and
    state stay fp32, the replicas are bit-identical where SPEC says they share, and the run
    follows the fp32 run's path to within bf16's rounding. (Written 2026-11-29: the docs
    recommended this, and no test had run it.)"""
    info = BY_NAME[name]
    communicating = {
        s for ph in info.phases(MP_STEPS, freeze=4) if ph.communicates for s in ph.steps
    }
    mixed = run_ranks(_bf16_compute, 4, name, reduce_dtype, True, timeout=TIMEOUT)
    fp32 = run_ranks(_bf16_compute, 4, name, None, False, timeout=TIMEOUT)
    for got, want in zip(mixed, fp32, strict=True):
        (losses, equal, dtypes, compressed, moved), (ref, _, ref_dtypes, _, ref_moved) = got, want
        assert compressed > 0
        assert dtypes == {torch.bfloat16, torch.float32} and ref_dtypes == {torch.float32}
        assert all(e for step, e in enumerate(equal, 1) if step in communicating), equal
        # bf16's rounding flips the 1-bit signs of elements near zero, so the paths part a
        # little (measured 0.08-0.21 of the distance moved); a step lost or of the wrong sign
        # would be 1 or 2
        assert (moved - ref_moved).norm() <= ref_moved.norm() / 3
        for got_loss, want_loss in zip(losses, ref, strict=True):
            assert abs(got_loss - want_loss) <= 0.02 * want_loss, (losses, ref)


def _accumulated(backend, name: str, how: str) -> torch.Tensor:
    """8 steps on 2 × 2, each on one batch of 8 (``"whole"``) or two micro-batches of 4 whose
    halved losses accumulate (``"accumulate"``), with FSDP2's reduce-scatter skipped on the
    first (``"no-sync"``: ``set_requires_gradient_sync(False)``, FSDP2's ``no_sync``)."""
    import commopt.fsdp

    del backend
    model, mesh = _sharded(_mlp(), 2, 2)
    opt = BY_NAME[name].make(list(model.parameters()), freeze=3)
    commopt.fsdp.attach(model, opt, mesh)
    for step in range(1, 9):
        x, y = _batch(step)
        halves = (
            [(x, y, 1.0)]
            if how == "whole"
            else zip(x.chunk(2), y.chunk(2), (0.5, 0.5), strict=True)
        )
        for i, (xs, ys, weight) in enumerate(halves):
            if how == "no-sync":
                model.set_requires_gradient_sync(i == 1)
            (weight * ((model(xs) - ys) ** 2).mean()).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([w.reshape(-1) for w in _gathered(model)])


@pytest.mark.parametrize("name", list(BY_NAME))
def test_gradient_accumulation_with_fsdp2s_no_sync_is_one_larger_batch(name) -> None:
    """Micro-batches, with FSDP2's reduce-scatter skipped on all but the last, step as one
    batch does: commopt's exchange across replicas runs in ``step()``, after FSDP2 has reduced
    what was accumulated. Equal to within rounding (the sums run in another order; measured
    ≤ 6e-7 after 8 steps through the warmup and the 1-bit stage)."""
    whole, accumulated, no_sync = (
        run_ranks(_accumulated, 4, name, how, timeout=TIMEOUT)[0]
        for how in ("whole", "accumulate", "no-sync")
    )
    assert float((accumulated - whole).abs().max()) <= 1e-5
    assert float((no_sync - whole).abs().max()) <= 1e-5
