"""commopt.ddp: a DDP-wrapped model trained through the hook equals the standalone optimizer.

Each rank trains two copies of the same model on the same batches: one wrapped in DDP with
``onebit_hook`` and its optimizer, one plain with the standalone optimizer. After every step
the two must agree bit for bit (parameters, and at the end every state buffer including the
error buffers), and the DDP replicas must be identical across ranks.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import commopt
from tests.multirank.harness import RankError, run_ranks
from tests.optim_registry import BY_NAME, OPTIMIZERS

TIMEOUT = 240
FREEZE = 3
STEPS = 8


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8), torch.nn.Linear(8, 3)
    )


def _batch(rank: int, step: int, k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + k)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


#: every step communicates (1-bit Adam, LAMB), or phase B has local steps (0/1 Adam)
ALWAYS_SYNCED = [info.name for info in OPTIMIZERS if info.synced_copy is None]
WITH_LOCAL_STEPS = [info.name for info in OPTIMIZERS if info.synced_copy is not None]
#: (optimizer, step, phase): the first step of each phase that communicates, in the registry's
#: backward-time schedule (1-bit Adam and LAMB: warmup and compression through the hook; 0/1
#: Adam's variance steps 1, 2, 4 averaged and 1-bit steps 3, 5 exchanged through it, phase B
#: (6–8) in step())
COMMUNICATING = [
    (i.name, step, phase) for i in OPTIMIZERS for step, phase in i.phase_starts(STEPS, True)
]


def _pair(backend, bucket_cap_mb: float, opt_bucket: int | None, extra: bool, name: str):
    """(ddp model, its optimizer, plain model, its optimizer, the extra scales or Nones).

    ``extra``: each optimizer also owns a parameter outside the DDP model (an output scale),
    so one optimizer bucket is only partly filled by the hook.
    """
    plain = _model()
    ddp = DistributedDataParallel(copy.deepcopy(plain), bucket_cap_mb=bucket_cap_mb)
    opts, scales = [], []
    for model in (ddp, plain):
        params = list(model.parameters())
        scales.append(torch.nn.Parameter(torch.ones(3)) if extra else None)
        if extra:
            params.append(scales[-1])
        opt = BY_NAME[name].make(params, mode="ddp-hook", backward=True, backend=backend)
        if opt_bucket is not None:
            opt._bucket_numel = opt_bucket  # several optimizer buckets, completed mid-backward
        opts.append(opt)
    ddp.register_comm_hook(
        commopt.ddp.OnebitHookState(opts[0], exchange_in_backward=True), commopt.ddp.onebit_hook
    )
    return ddp, opts[0], plain, opts[1], scales


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _state(opt) -> list[torch.Tensor]:
    out = []
    for s in opt.flat_states:
        out += [v.clone() for _, v in sorted(s.flat.items())]
        out += [v.clone() for _, v in sorted(s.scalars.items())]
        out += [v.clone() for v in s.comm.values()]
    return out


def _train(
    backend,
    bucket_cap_mb: float,
    opt_bucket: int | None,
    micro: int = 1,
    bad_step: int = 0,
    extra: bool = False,
    name: str = "OnebitAdam",
):
    """Train both copies; return per-step comparisons and the communication counts."""
    warnings.simplefilter("ignore")
    ddp, opt, plain, ref, (scale, scale_ref) = _pair(
        backend, bucket_cap_mb, opt_bucket, extra, name
    )

    def loss(model, scale, x, y):
        out = model(x) if scale is None else model(x) * scale
        return torch.nn.functional.mse_loss(out, y).div(micro)

    rank = backend.rank
    same_as_plain, calls_in_no_sync, untouched_at_bad = [], [], None
    compressed_in_step, full_in_step = [], []
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        ref.zero_grad()
        for k in range(micro):
            x, y = _batch(rank, step, k)
            if step == bad_step and rank == 1 and k == micro - 1:
                x = x.clone()
                x[0, 0] = float("inf")  # a non-finite gradient on one rank only
            before = backend.stats.snapshot()
            if k < micro - 1:
                with ddp.no_sync():
                    loss(ddp, scale, x, y).backward()
                calls_in_no_sync.append((backend.stats - before).calls)
            else:
                loss(ddp, scale, x, y).backward()
            loss(plain, scale_ref, x, y).backward()
        if step == bad_step:
            saved = (_flat(ddp).clone(), _state(opt))
        before = opt.comm_stats()
        opt.step()
        after = opt.comm_stats()
        compressed_in_step.append(after["compressed_rounds"] - before["compressed_rounds"])
        full_in_step.append(after["full_precision_rounds"] - before["full_precision_rounds"])
        ref.step()
        if step == bad_step:
            untouched_at_bad = torch.equal(saved[0], _flat(ddp)) and all(
                torch.equal(a, b) for a, b in zip(saved[1], _state(opt), strict=True)
            )
        same_as_plain.append(torch.equal(_flat(ddp), _flat(plain)))
    flat = _flat(ddp)
    everyone = torch.empty(backend.world_size * flat.numel())
    backend.all_gather(everyone, flat)
    states_equal = all(torch.equal(a, b) for a, b in zip(_state(opt), _state(ref), strict=True))
    return {
        "same_as_plain": same_as_plain,
        "states_equal": states_equal,
        "replicas": everyone.view(backend.world_size, -1),
        "calls_in_no_sync": calls_in_no_sync,
        "untouched_at_bad": untouched_at_bad,
        "skipped": opt.comm_stats()["skipped_steps"],
        "skipped_ref": ref.comm_stats()["skipped_steps"],
        "compressed_rounds": opt.comm_stats()["compressed_rounds"],
        "compressed_in_step": compressed_in_step,
        "full_in_step": full_in_step,
        "full_rounds_ref": ref.comm_stats()["full_precision_rounds"],
        "buckets": len(opt.flat_states),
    }


def _check_replicas(results):
    for r in results:
        for replica in r["replicas"][1:]:
            assert torch.equal(r["replicas"][0], replica)


@pytest.mark.parametrize("name", ALWAYS_SYNCED)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    ("bucket_cap_mb", "opt_bucket"),
    [(25.0, None), (1e-4, None), (1e-4, 100)],
    ids=["one-ddp-bucket", "ddp-bucket-per-tensor", "several-optimizer-buckets"],
)
def test_hook_equals_standalone_every_step(bucket_cap_mb, opt_bucket, world_size, name):
    # At 4 ranks too: the hook averages (warmup) and exchanges (compression) the optimizer's
    # buckets, never DDP's, so the reduction order is the standalone optimizer's. 1-bit LAMB
    # scales by σ around its exchange, frozen at step FREEZE + 1 from the committed momenta.
    results = run_ranks(
        _train, world_size, bucket_cap_mb, opt_bucket, 1, 0, False, name, timeout=TIMEOUT
    )
    _check_replicas(results)
    for r in results:
        # warmup (steps 1-3) and compression (4-8): parameters identical after every step
        assert r["same_as_plain"] == [True] * STEPS, r["same_as_plain"]
        assert r["states_equal"]  # m, v, worker and server errors
        # the hook did the compressed exchanges, during backward; step() did none
        assert r["compressed_rounds"] == (STEPS - FREEZE) * r["buckets"]
        assert r["compressed_in_step"] == [0] * STEPS
        assert r["full_in_step"] == [0] * STEPS
    assert results[0]["buckets"] == (4 if opt_bucket else 1)


@pytest.mark.parametrize("name", list(BY_NAME))
def test_no_sync_accumulation_communicates_nothing_and_equals_standalone(name):
    results = run_ranks(_train, 2, 1e-4, 100, 3, 0, False, name, timeout=TIMEOUT)
    _check_replicas(results)
    for r in results:
        assert r["calls_in_no_sync"] == [0] * (2 * STEPS)
        assert r["same_as_plain"] == [True] * STEPS, r["same_as_plain"]
        assert r["states_equal"]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    ("name", "bad_step", "phase"), COMMUNICATING, ids=[f"{n}-{ph}" for n, _, ph in COMMUNICATING]
)
def test_nonfinite_gradient_on_one_rank_skips_everywhere_untouched(
    bad_step, phase, world_size, name
):
    # Several optimizer buckets: those without the inf are exchanged during backward and must
    # be dropped, not committed, when the step is skipped (1-bit LAMB at step 4: σ too).
    results = run_ranks(_train, world_size, 1e-4, 100, 1, bad_step, False, name, timeout=TIMEOUT)
    del phase
    if name in ALWAYS_SYNCED:  # else replicas part between syncs; the skip moves the schedule
        _check_replicas(results)
    for r in results:
        assert r["untouched_at_bad"] is True
        assert r["skipped"] == r["skipped_ref"] == 1
        assert r["same_as_plain"] == [True] * STEPS, r["same_as_plain"]
        assert r["states_equal"]


@pytest.mark.parametrize("name", list(BY_NAME))
@pytest.mark.parametrize("opt_bucket", [None, 100], ids=["one-optimizer-bucket", "several"])
def test_optimizer_parameter_outside_ddp_model(opt_bucket, name):
    # The optimizer also owns a parameter DDP never sees: its bucket is completed by step()
    # (warmup: averaged there; compression: folded and exchanged there), still bit-identical.
    results = run_ranks(_train, 2, 1e-4, opt_bucket, 2, 0, True, name, timeout=TIMEOUT)
    _check_replicas(results)
    for r in results:
        assert r["same_as_plain"] == [True] * STEPS, r["same_as_plain"]
        assert r["states_equal"]


def _foreign(backend):
    """A layer trained by another optimizer gets DDP's plain average from the hook."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    ddp = DistributedDataParallel(copy.deepcopy(model))
    opt = commopt.OnebitAdam(ddp.module[1].parameters(), lr=0.01, freeze_step=1)
    sgd = torch.optim.SGD(ddp.module[0].parameters(), lr=0.1)
    ddp.register_comm_hook(
        commopt.ddp.OnebitHookState(opt, exchange_in_backward=True), commopt.ddp.onebit_hook
    )
    checks = []
    for step in range(1, 4):  # warmup, then compression: the foreign layer is averaged in both
        x, y = _batch(backend.rank, step)
        x = x[:, :4]
        y = y[:, :2]
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        local = [p.grad.clone() for p in model.parameters()]
        opt.zero_grad()
        sgd.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        w = local[0].clone()
        backend.all_reduce(w, "avg")
        checks.append(
            (
                torch.equal(ddp.module[0].weight.grad, w),
                # commopt's layer: averaged in warmup, local in the compression stage
                torch.equal(ddp.module[1].weight.grad, local[2]),
            )
        )
        sgd.step()
        opt.step()
        model.load_state_dict(ddp.module.state_dict())
    return checks


def test_parameters_of_another_optimizer_get_ddp_average():
    for checks in run_ranks(_foreign, 2, timeout=TIMEOUT):
        assert [c[0] for c in checks] == [True, True, True]
        assert [c[1] for c in checks] == [False, True, True]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    ("bucket_cap_mb", "opt_bucket"),
    [(25.0, None), (1e-4, None), (1e-4, 100)],
    ids=["one-ddp-bucket", "ddp-bucket-per-tensor", "several-optimizer-buckets"],
)
@pytest.mark.parametrize("name", WITH_LOCAL_STEPS)
def test_hook_with_local_steps_equals_standalone(bucket_cap_mb, opt_bucket, world_size, name):
    # Variance steps (1, 2, 4) averaged and 1-bit steps (3, 5) exchanged through the hook;
    # phase B keeps local gradients in DDP and communicates in step() (sync steps 6 and 8).
    results = run_ranks(
        _train, world_size, bucket_cap_mb, opt_bucket, 1, 0, False, name, timeout=TIMEOUT
    )
    _check_replicas(results)
    for r in results:
        buckets = r["buckets"]
        assert r["full_rounds_ref"] == 3 * buckets  # the standalone optimizer averages in step()
        assert r["full_in_step"] == [0] * STEPS  # the DDP one never does (the hook did)
        # 1-bit steps exchanged during backward; only the sync steps exchange in step()
        assert r["compressed_in_step"] == [0, 0, 0, 0, 0, buckets, 0, buckets]
        assert r["compressed_rounds"] == 4 * buckets
        assert r["same_as_plain"] == [True] * STEPS, r["same_as_plain"]
        assert r["states_equal"]


def _grad_scaler(backend):
    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Linear(4, 2))
    opt = commopt.OnebitAdam(ddp.parameters(), lr=0.01, freeze_step=1, backend=backend)
    ddp.register_comm_hook(
        commopt.ddp.OnebitHookState(opt, exchange_in_backward=True), commopt.ddp.onebit_hook
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    for step in range(1, 3):  # the warmup step works; the compression step refuses
        x, _ = _batch(backend.rank, step)
        opt.zero_grad()
        scaler.scale(ddp(x[:, :4]).square().mean()).backward()
        scaler.step(opt)
        scaler.update()


def test_grad_scaler_in_compression_stage_is_refused_on_every_rank():
    with pytest.raises(RankError) as err:
        run_ranks(_grad_scaler, 2, timeout=TIMEOUT)
    for message in err.value.messages:
        assert message is not None and "before GradScaler could unscale" in message
        assert "_grad_scaler" in message and "scaler.step(opt)" in message


def test_hook_state_needs_a_commopt_optimizer():
    sgd = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"needs a commopt optimizer .* got SGD"):
        commopt.ddp.OnebitHookState(sgd)


def test_hook_state_refuses_an_optimizer_with_overlap():
    opt = commopt.OnebitAdam(torch.nn.Linear(2, 2).parameters(), overlap=True)
    with pytest.raises(ValueError, match="overlap=True"):
        commopt.ddp.OnebitHookState(opt)


def _bf16_under_ddp(backend, name: str, hook: bool):
    # A bf16 layer among fp32 ones: the fp32 master weights must leave DDP's gradient hooks on
    # the bf16 parameters in place (swapping their .data to fp32 inside step() dropped them,
    # and DDP then waited at the second step for gradients that never came).
    torch.manual_seed(0)
    model = _model()
    model[2].to(torch.bfloat16)
    model.forward = lambda x: model[3](model[2](model[1](model[0](x)).bfloat16()).float())
    ddp = DistributedDataParallel(model)
    opt = BY_NAME[name].make(ddp.parameters(), mode="ddp-hook", backward=True, backend=backend)
    if hook:
        ddp.register_comm_hook(
            commopt.ddp.OnebitHookState(opt, exchange_in_backward=True), commopt.ddp.onebit_hook
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (without the hook: "gradients already identical")
        for step in range(1, STEPS + 1):
            x, y = _batch(backend.rank, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
    out = torch.empty(backend.world_size * _flat(model).numel())
    backend.all_gather(out, _flat(model).float())
    dtypes = {str(p.dtype) for p in model[2].parameters()}
    return {"replicas": list(out.view(backend.world_size, -1)), "dtypes": dtypes}


@pytest.mark.parametrize("hook", [True, False], ids=["hook", "no-hook"])
@pytest.mark.parametrize("name", list(BY_NAME))
def test_bf16_parameters_under_ddp_train_and_stay_identical(name, hook):
    results = run_ranks(_bf16_under_ddp, 2, name, hook, timeout=TIMEOUT)
    _check_replicas(results)
    assert all(r["dtypes"] == {"torch.bfloat16"} for r in results)
