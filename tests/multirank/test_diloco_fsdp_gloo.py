"""commopt.DiLoCo over FSDP2 shards, on a 2 × 2 (replicate, shard) mesh of forked gloo ranks.

Each replica is one DiLoCo worker: FSDP2 shards it over the shard group, whose reduce-scatter
averages the gradients inside the island at every inner step, and DiLoCo averages each shard's
pseudo-gradient with the ranks holding the same shard (``backend`` over the replicate group).
The same computation on whole parameters: DiLoCo over the replicate group, each rank taking
its island's two batches at once. Close but not bit for bit: FSDP2 averages two gradients by a
reduce-scatter where the reference differentiates the mean loss of both batches. Also: the
refusals of a wrong group or topology, a resume mid-interval from the state dict in memory
and through DCP (commopt.fsdp.save_checkpoint), bit-exact, and GradScaler with an inf in one
shard."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join

import commopt
from tests.multirank.harness import run_ranks

TIMEOUT = 240.0
H, STEPS, D = 4, 12, 16


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, 4))


def _sharded(**kw):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["shard"], **kw)
    fully_shard(model, mesh=mesh["shard"], **kw)
    return model, mesh


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, D, generator=g) + 0.5 * rank  # every rank its own distribution
    return x, x[:, :4].sin()


def _step(model, opt, x, y) -> float:
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def _against_whole(backend, compression, fp32_syncs=None):
    """(largest difference to the whole-parameter run / its largest parameter, per step; the
    shards bit-identical across replicas after every sync; first and last loss; sync bytes of
    the sharded and the whole run)."""
    del backend
    rank = dist.get_rank()
    model, mesh = _sharded()
    replicate = commopt.TorchBackend(mesh.get_group("replicate"))
    kw = dict(sync_every=H, compression=compression, fp32_syncs=fp32_syncs, backend=replicate)
    opt = commopt.DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), **kw)
    whole = _mlp()
    whole_opt = commopt.DiLoCo(torch.optim.AdamW(whole.parameters(), lr=1e-2), **kw)
    island = [rank - rank % 2, rank - rank % 2 + 1]  # the ranks of this rank's shard group
    diffs, synced_equal, losses = [], [], []
    for step in range(1, STEPS + 1):
        losses.append(_step(model, opt, *_batch(rank, step)))
        both = [_batch(r, step) for r in island]
        _step(whole, whole_opt, torch.cat([b[0] for b in both]), torch.cat([b[1] for b in both]))
        full = [p.full_tensor().detach() for p in model.parameters()]
        ref = [p.detach() for p in whole.parameters()]
        top = max(float(r.abs().max()) for r in ref)
        diffs.append(max(float((f - r).abs().max()) for f, r in zip(full, ref, strict=True)) / top)
        if step % H == 0:
            local = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
            other = torch.empty(2 * local.numel())
            replicate.all_gather(other, local)
            synced_equal.append(torch.equal(other[: local.numel()], other[local.numel() :]))
    sent = opt.comm_stats()["sync_bytes"], whole_opt.comm_stats()["sync_bytes"]
    return diffs, synced_equal, (losses[0], losses[-1]), sent


def test_fp32_diloco_on_shards_equals_it_on_whole_parameters_within_rounding() -> None:
    for diffs, synced_equal, _, (sharded, whole) in run_ranks(
        _against_whole, 4, "none", timeout=TIMEOUT
    ):
        assert max(diffs) < 1e-5, diffs
        assert synced_equal == [True] * (STEPS // H)
        assert sharded < 0.6 * whole  # each rank sends its shard: about half at S = 2


def test_onebit_diloco_on_shards_keeps_replicas_identical_and_sends_a_shard() -> None:
    """The first sync at fp32, the other two at 1 bit: each shard's exchange has its own scales,
    so the numbers are not the whole run's, but the replicas are one model after every sync, it
    learns, and each rank sends about its shard's share."""
    for diffs, synced_equal, (first, last), (sharded, whole) in run_ranks(
        _against_whole, 4, "onebit", 1, timeout=TIMEOUT
    ):
        assert max(diffs[:H]) < 1e-5 < diffs[-1]  # the 1-bit syncs are the shards' own
        assert synced_equal == [True] * (STEPS // H)
        assert last < 0.7 * first, (first, last)
        assert sharded < 0.6 * whole


def _bf16_compute(backend):
    """STEPS inner steps of 1-bit DiLoCo (first sync at fp32) on shards that FSDP2 computes in
    bf16 (``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    del backend
    rank = dist.get_rank()
    model, mesh = _sharded(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    replicate = commopt.TorchBackend(mesh.get_group("replicate"))
    kw = dict(sync_every=H, fp32_syncs=1, backend=replicate)  # the first sync at fp32
    opt = commopt.DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), **kw)
    losses, synced_equal = [], []
    for step in range(1, STEPS + 1):
        x, y = _batch(rank, step)
        out = model(x)
        loss = ((out.float() - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append((float(loss), out.dtype))
        if step % H == 0:
            local = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
            other = torch.empty(2 * local.numel())
            replicate.all_gather(other, local)
            synced_equal.append(torch.equal(other[: local.numel()], other[local.numel() :]))
    kept = {p.dtype for p in model.parameters()}
    return losses, synced_equal, kept


def test_bf16_compute_through_fsdp2s_mixed_precision_policy_keeps_the_replicas_one_model() -> None:
    """docs/fsdp.md's way to low precision, under DiLoCo: FSDP2 computes in bf16, the sharded
    parameters stay fp32, and the replicas are one model after every sync."""
    for losses, synced_equal, kept in run_ranks(_bf16_compute, 4, timeout=TIMEOUT):
        assert {dtype for _, dtype in losses} == {torch.bfloat16}
        assert kept == {torch.float32}
        assert synced_equal == [True] * (STEPS // H)
        assert losses[-1][0] < 0.7 * losses[0][0], losses


def _refusals(backend):
    del backend
    model, mesh = _sharded()
    errors = {}
    cases = {
        "whole job": dict(),
        "hierarchical": dict(
            backend=commopt.TorchBackend(mesh.get_group("replicate")), topology="hierarchical"
        ),
    }
    for name, kw in cases.items():
        try:
            commopt.DiLoCo(torch.optim.AdamW(model.parameters()), sync_every=H, **kw)
        except ValueError as err:
            errors[name] = str(err)
    replicate = commopt.TorchBackend(mesh.get_group("replicate"))
    opt = commopt.DiLoCo(torch.optim.AdamW(model.parameters()), sync_every=H, backend=replicate)
    try:
        Join([opt])
    except ValueError as err:
        errors["join"] = str(err)
    return errors


def test_the_wrong_group_or_topology_is_a_clear_error() -> None:
    for errors in run_ranks(_refusals, 4, timeout=TIMEOUT):
        assert "hold different FSDP2 shards" in errors["whole job"]
        assert "rank 0 shard 0 of 2, rank 1 shard 1 of 2" in errors["whole job"]
        assert "mesh.get_group('replicate')" in errors["whole job"]
        assert "already is the island" in errors["hierarchical"]
        assert "FSDP2 is no joinable" in errors["join"]


def _resume(backend, path):
    """Train 14 steps; or 10, then a fresh model and DiLoCo restored, then 4 more: equal shards?
    ``path`` None: through ``state_dict()`` in memory (per rank); else through
    ``commopt.fsdp.save_checkpoint`` / ``load_checkpoint`` (DCP, on disk)."""
    import commopt.fsdp

    del backend
    rank = dist.get_rank()

    def build():
        model, mesh = _sharded()
        replicate = commopt.TorchBackend(mesh.get_group("replicate"))
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, commopt.DiLoCo(inner, sync_every=H, fp32_syncs=1, backend=replicate)

    model, opt = build()
    for step in range(1, 15):
        _step(model, opt, *_batch(rank, step))
    straight = [p.to_local().detach().clone() for p in model.parameters()]
    model, opt = build()
    for step in range(1, 11):  # mid-interval, with the errors of the 1-bit sync at step 8
        _step(model, opt, *_batch(rank, step))
    if path is None:
        saved = opt.state_dict()
        params = [p.to_local().detach().clone() for p in model.parameters()]
        model, opt = build()
        with torch.no_grad():
            for p, v in zip(model.parameters(), params, strict=True):
                p.to_local().copy_(v)
        opt.load_state_dict(saved)
    else:
        commopt.fsdp.save_checkpoint(path, model, opt)
        model, opt = build()
        commopt.fsdp.load_checkpoint(path, model, opt)
    for step in range(11, 15):  # the 1-bit sync at 12 uses them
        _step(model, opt, *_batch(rank, step))
    return all(
        torch.equal(a, p.to_local()) for a, p in zip(straight, model.parameters(), strict=True)
    )


def test_a_resume_from_the_state_dict_mid_interval_is_bit_exact() -> None:
    """Per rank, in memory: the state dict holds the inner AdamW's sharded state, each shard's
    anchor and this rank's error buffers."""
    assert all(run_ranks(_resume, 4, None, timeout=TIMEOUT))


def _other_mesh(backend, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import commopt.fsdp

    del backend
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    model = _mlp()
    fully_shard(model, mesh=mesh["shard"])
    replicate = commopt.TorchBackend(mesh.get_group("replicate"))
    opt = commopt.DiLoCo(torch.optim.AdamW(model.parameters()), sync_every=H, backend=replicate)
    try:
        commopt.fsdp.load_checkpoint(path, model, opt)
    except ValueError as err:
        return str(err)
    return None


def test_a_dcp_resume_is_bit_exact_and_another_mesh_is_refused(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    assert all(run_ranks(_resume, 4, path, timeout=TIMEOUT))
    for message in run_ranks(_other_mesh, 2, path, timeout=TIMEOUT):
        assert message is not None and "resumes at the mesh it was saved at" in message


def _scaled(backend, warmup: int, use_scaler: bool):
    """2H steps; with ``use_scaler`` through GradScaler with an inf in rank 0's shard at step 3,
    else plain, with the gradients dropped where that inf skips the inner step: replica 0 (ranks
    0 and 1) without warmup, every rank within it."""
    del backend
    rank = dist.get_rank()
    model, mesh = _sharded()
    replicate = commopt.TorchBackend(mesh.get_group("replicate"))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = commopt.DiLoCo(inner, sync_every=H, fp32_syncs=1, warmup_steps=warmup, backend=replicate)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # a power of 2: unscaling is exact
    for step in range(1, 2 * H + 1):
        x, y = _batch(rank, step)
        loss = ((model(x) - y) ** 2).mean()
        if use_scaler:
            scaler.scale(loss).backward()
            if step == 3 and rank == 0:
                next(model.parameters()).grad.to_local()[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            if step == 3 and (warmup or rank < 2):
                opt.zero_grad()
            opt.step()
        opt.zero_grad()
    shard = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
    return shard, opt.comm_stats()["skipped_steps"], scaler.get_scale()


def test_grad_scaler_skips_the_inner_step_of_the_whole_replica_that_overflowed() -> None:
    """One shard's inf: GradScaler's check of the DTensor gradients agrees over the shard group,
    so the replica skips whole (both its shards); during warmup, where the replicas average
    gradients, every rank skips. Bit for bit the run that dropped those inner steps."""
    for warmup, skips in ((0, [1, 1, 0, 0]), (H, [1, 1, 1, 1])):
        scaled = run_ranks(_scaled, 4, warmup, True, timeout=TIMEOUT)
        plain = run_ranks(_scaled, 4, warmup, False, timeout=TIMEOUT)
        for rank, ((shard, skipped, scale), (expected, _, _)) in enumerate(
            zip(scaled, plain, strict=True)
        ):
            assert torch.equal(shard, expected), (warmup, rank)
            assert skipped == skips[rank], (warmup, rank, skipped)
            assert scale == (2.0**9 if rank < 2 else 2.0**10)  # replica 0 saw the inf
        assert torch.equal(scaled[0][0], scaled[2][0])  # step 2H is a sync either way
