"""OnebitAdam on forked gloo ranks (SPEC §2): warmup equals AdamW on the averaged gradient,
replicas stay bit-identical in the compression stage, one compressed call per bucket per step,
convergence like Adam, and model mismatches and sparse gradients that fail on every rank alike.
Resume and non-finite skips in every phase: tests/multirank/common_bodies.py (all optimizers)."""

from __future__ import annotations

import math

import torch

import commopt
import commopt.exchange.flat
from commopt import OnebitAdam
from commopt.comm import model_bytes
from commopt.compressed import compression_bytes
from tests.multirank.harness import run_ranks

TIMEOUT = 240.0

# Three groups with different hyperparameters; the first carries a momentum mask.
GROUP_OPTS = [
    {"lr": 4e-3, "betas": (0.9, 0.999), "weight_decay": 0.05},
    {"lr": 1e-2, "betas": (0.8, 0.99), "weight_decay": 0.0},
    {"lr": 6e-3, "betas": (0.95, 0.995), "weight_decay": 0.01},
]
WARMUP, COMPRESSED = 5, 8


def make_model(seed: int = 0, hidden: int = 12) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(5, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, 6),
        torch.nn.Tanh(),
        torch.nn.Linear(6, 2),
    )


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(96, 5, generator=gen)
    return x, torch.sin(x[:, :2] * 2) + 0.1 * torch.randn(96, 2, generator=gen)


def shard_loss(model, rank: int, n: int) -> torch.Tensor:
    x, y = dataset()
    return ((model(x[rank::n]) - y[rank::n]) ** 2).mean()


def make_groups(model: torch.nn.Module, mask: torch.Tensor | None = None) -> list[dict]:
    p = list(model.parameters())  # 6 tensors: [w0], [b0, w1], [b1, w2, b2]
    spans = [(0, 1), (1, 3), (3, 6)]
    groups = [{"params": p[a:b], **GROUP_OPTS[i]} for i, (a, b) in enumerate(spans)]
    if mask is not None:
        groups[0]["exp_avg_mask"] = mask
    return groups


def first_layer_mask(hidden: int = 12) -> torch.Tensor:
    mask = torch.ones(hidden, 5)
    mask[1] = 0
    mask[:, 3] = 0
    return mask


# -- warmup equivalence, bit-identical replicas, one call per bucket -----------------------------
def _lockstep(backend):
    n, rank = backend.world_size, backend.rank
    model = make_model(seed=100 + rank)  # different on purpose: broadcast must fix it
    commopt.broadcast_parameters(model, backend=backend)
    mask = first_layer_mask()
    opt = OnebitAdam(make_groups(model, mask), freeze_step=WARMUP, backend=backend)
    opt._bucket_numel = 40  # several buckets, some spanning two groups

    calls: list[int] = []
    real = commopt.exchange.flat.compressed_allreduce_and_scale

    def counting(tensor, worker_error, server_error, be=None, **kw):
        calls.append(tensor.numel())
        return real(tensor, worker_error, server_error, be, **kw)

    commopt.exchange.flat.compressed_allreduce_and_scale = counting
    per_step = []
    after_warmup = None
    masked_zero = []
    for t in range(1, WARMUP + COMPRESSED + 1):
        before = backend.stats.snapshot()
        calls.clear()
        opt.zero_grad()
        shard_loss(model, rank, n).backward()
        opt.step()
        delta = backend.stats - before
        per_step.append(
            (
                {k: v for k, v in delta.calls_by_op.items() if v},
                delta.bytes_sent,
                list(calls),
            )
        )
        if t == WARMUP:
            after_warmup = [p.detach().clone() for p in model.parameters()]
        if t > WARMUP:
            m = opt.state[model[0].weight]["exp_avg"]
            masked_zero.append(bool((m[mask == 0] == 0).all()))
    commopt.exchange.flat.compressed_allreduce_and_scale = real
    bucket_numels = [b.numel for b in [s.bucket for s in opt.flat_states]]
    state = [
        (opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
        for p in model.parameters()
    ]
    errors = [e["worker_error"].clone() for e in [s.comm for s in opt.flat_states]]
    return {
        "n_params": len(list(model.parameters())),
        "warmup": after_warmup,
        "final": [p.detach().clone() for p in model.parameters()],
        "state": state,
        "errors": errors,
        "per_step": per_step,
        "buckets": bucket_numels,
        "masked_zero": masked_zero,
        "rounds": (
            opt.comm_stats()["full_precision_rounds"],
            opt.comm_stats()["compressed_rounds"],
        ),
    }


def reference_warmup() -> list[torch.Tensor]:
    """torch.optim.AdamW on the full data: the average of equal-sized shard losses."""
    model = make_model(seed=100)  # rank 0's initialisation, which broadcast_parameters spread
    opt = torch.optim.AdamW(make_groups(model))
    x, y = dataset()
    for _ in range(WARMUP):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_four_ranks_warmup_replicas_and_call_count():
    n = 4
    results = run_ranks(_lockstep, n, timeout=TIMEOUT)
    r0 = results[0]

    # Warmup: AdamW on the averaged gradient, with decoupled weight decay, per group.
    for p, q in zip(r0["warmup"], reference_warmup(), strict=True):
        assert (p - q).abs().max() <= 1e-6

    # Compression stage: parameters and both moments bit-identical on every rank.
    for rank, res in enumerate(results[1:], start=1):
        for p, q in zip(res["final"], r0["final"], strict=True):
            assert torch.equal(p, q), f"rank {rank} parameters differ"
        for (m, v), (m0, v0) in zip(res["state"], r0["state"], strict=True):
            assert torch.equal(m, m0) and torch.equal(v, v0), f"rank {rank} state differs"
    # ... while the worker errors are each rank's own.
    assert not torch.equal(results[1]["errors"][0], r0["errors"][0])
    assert all(all(res["masked_zero"]) for res in results)
    # The compression stage really moved the parameters.
    assert any(not torch.equal(a, b) for a, b in zip(r0["warmup"], r0["final"], strict=True))

    # Communication: one full-precision all-reduce per bucket in warmup; one compressed call
    # (four collectives) per bucket afterwards; plus the one flag all-reduce of every step.
    buckets = r0["buckets"]
    assert len(buckets) >= 3
    assert r0["rounds"] == (WARMUP * len(buckets), COMPRESSED * len(buckets))
    # 2 flags (sparse, non-finite), the model key and its negation, the gradient digest and its
    # negation (DDP-without-hook check), the redo flag (overlap), the settings key and its
    # negation, and one has-gradient flag per parameter, int64
    flag_bytes = model_bytes("all_reduce", (9 + r0["n_params"]) * 8, n)
    for res in results:
        for t, (ops, nbytes, calls) in enumerate(res["per_step"], start=1):
            if t <= WARMUP:
                assert ops == {"all_reduce": 1 + len(buckets) + (t == 1) * 2}, t
                assert calls == []
            else:
                assert ops == {
                    "all_reduce": 1,
                    "all_gather": 3 * len(buckets),
                    "all_to_all": len(buckets),
                }, t
                assert calls == buckets, "one compressed call per bucket, the whole bucket"
                expect = flag_bytes + sum(compression_bytes(k, n) for k in buckets)
                assert nbytes == expect


# -- the compression stage against a reference built on compressed_allreduce ---------------------
def _against_reference(backend):
    """Run OnebitAdam and, beside it, SPEC §2 written out with commopt.compressed_allreduce as
    the (separately tested) primitive: the momentum of the whole model, not the gradient, is
    what travels; then the mask; bias correction with v frozen at step freeze_step."""
    n, rank = backend.world_size, backend.rank
    model = make_model(seed=21)
    mask = first_layer_mask()
    # SPEC §2 as written: the papers' step, without commopt's default step guard
    opt = OnebitAdam(
        make_groups(model, mask), freeze_step=WARMUP, step_guard=False, backend=backend
    )
    groups = make_groups(make_model(seed=21), mask)  # same numbers, owned by the reference
    params = [p.detach().clone() for g in groups for p in g["params"]]
    owner = [gi for gi, g in enumerate(groups) for _ in g["params"]]
    sizes = [p.numel() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    total = sum(sizes)
    e = torch.zeros(commopt.padded_size(total, n))
    f = torch.zeros(e.numel() // n)
    worst = []
    for t in range(1, WARMUP + COMPRESSED + 1):
        opt.zero_grad()
        shard_loss(model, rank, n).backward()
        opt.step()
        # The reference sees this rank's gradient at the reference's own parameters.
        work = make_model(seed=21)
        with torch.no_grad():
            for w, p in zip(work.parameters(), params, strict=True):
                w.copy_(p)
        shard_loss(work, rank, n).backward()
        grads = [w.grad.clone() for w in work.parameters()]
        if t <= WARMUP:
            for g in grads:
                backend.all_reduce(g, "avg")
        for i, g in enumerate(grads):
            b1, b2 = groups[owner[i]]["betas"]
            m[i] = b1 * m[i] + (1 - b1) * g
            if t <= WARMUP:
                v[i] = b2 * v[i] + (1 - b2) * g * g
        if t > WARMUP:
            flat = commopt.compressed_allreduce(torch.cat([x.reshape(-1) for x in m]), e, f)
            m = [c.view_as(x) for c, x in zip(flat.split(sizes), m, strict=True)]
            m[0] = m[0] * mask
        for i in range(len(params)):
            opts = groups[owner[i]]
            b1, b2 = opts["betas"]
            m_hat = m[i] / (1 - b1**t)
            v_hat = v[i] / (1 - b2 ** min(t, WARMUP))
            step = m_hat / (v_hat.sqrt() + 1e-8) + opts["weight_decay"] * params[i]
            params[i] = params[i] - opts["lr"] * step
        worst.append(
            max((p - q).abs().max().item() for p, q in zip(model.parameters(), params, strict=True))
        )
    return worst


def test_two_ranks_compression_stage_matches_reference():
    results = run_ranks(_against_reference, 2, timeout=TIMEOUT)
    for rank, worst in enumerate(results):
        assert max(worst) <= 1e-6, f"rank {rank}: largest parameter difference per step {worst}"


# -- convergence ----------------------------------------------------------------------------------
STEPS, FREEZE, LR, DIM = 150, 30, 0.1, 20


def _regression(backend):
    """Linear regression with noise, a different shard per rank, cosine learning rate."""
    n, rank = backend.world_size, backend.rank
    gen = torch.Generator().manual_seed(123)
    x = torch.randn(4096, DIM, generator=gen)
    y = x @ torch.randn(DIM, 1, generator=gen) + 1.0 + 0.5 * torch.randn(4096, 1, generator=gen)
    xs, ys = x[rank::n], y[rank::n]
    final = {}
    for name in ("adam", "onebit"):
        torch.manual_seed(1 + rank)
        model = torch.nn.Linear(DIM, 1)
        commopt.broadcast_parameters(model, backend=backend)
        if name == "onebit":
            opt = OnebitAdam(model.parameters(), lr=LR, freeze_step=FREEZE, backend=backend)
        else:
            opt = torch.optim.Adam(model.parameters(), lr=LR)
        batches = torch.Generator().manual_seed(7 + rank)
        for k in range(STEPS):
            opt.param_groups[0]["lr"] = LR * 0.5 * (1 + math.cos(math.pi * k / STEPS))
            idx = torch.randint(0, xs.shape[0], (16,), generator=batches)
            opt.zero_grad()
            ((model(xs[idx]) - ys[idx]) ** 2).mean().backward()
            if name == "adam":  # plain data-parallel Adam: average the gradients at fp32
                for p in model.parameters():
                    backend.all_reduce(p.grad, "avg")
            opt.step()
        with torch.no_grad():
            final[name] = ((model(x) - y) ** 2).mean().item()
            final[name + "_params"] = torch.cat([p.reshape(-1) for p in model.parameters()])
    return final


def test_four_ranks_reach_the_loss_of_adam():
    results = run_ranks(_regression, 4, timeout=TIMEOUT)
    adam, onebit = results[0]["adam"], results[0]["onebit"]
    for res in results:
        assert torch.equal(res["onebit_params"], results[0]["onebit_params"])
    initial = 1.0 + DIM  # E[(y - 0)^2] order of magnitude: the runs must have learned
    assert adam < 0.05 * initial
    assert abs(onebit - adam) <= 0.02 * adam, (onebit, adam)


# -- failures reach every rank --------------------------------------------------------------------
def _outcome(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as err:  # the test inspects type and message on every rank
        return type(err).__name__, str(err)
    return "ok", ""


def _failures(backend):
    n, rank = backend.world_size, backend.rank
    out = {}

    # A sparse gradient on one rank only (rank 0): every rank raises.
    emb = torch.nn.Embedding(10, 3, sparse=(rank == 0))
    opt = OnebitAdam(emb.parameters(), freeze_step=2, backend=backend)
    emb(torch.tensor([1, 2, 2])).sum().backward()
    out["sparse"] = _outcome(opt.step)

    # The last rank has one parameter more.
    params = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(2, 3))]
    if rank == n - 1:
        params.append(torch.nn.Parameter(torch.ones(5)))
    opt = OnebitAdam([{"params": params[:1]}, {"params": params[1:]}], backend=backend)
    for p in params:
        p.grad = torch.ones_like(p)
    out["count"] = _outcome(opt.step)

    # Rank 1 builds a different hidden size: the second tensor (first bias) is the first mismatch.
    model = make_model(hidden=12 if rank != 1 else 13)
    opt = OnebitAdam(make_groups(model), backend=backend)
    shard_loss(model, rank, n).backward()
    out["shape"] = _outcome(opt.step)
    return out


def test_two_ranks_errors_on_every_rank():
    n = 2
    results = run_ranks(_failures, n, timeout=TIMEOUT)
    for rank, res in enumerate(results):
        kind, msg = res["sparse"]
        assert kind == "RuntimeError" and "does not support sparse gradients" in msg
        if rank == 0:
            assert "param_groups[0]['params'][0]" in msg
        kind, msg = res["count"]
        assert kind == "ValueError", res["count"]
        assert "parameter count differs between ranks" in msg
        assert "the largest is 3 and the smallest 2" in msg and "flat index 2" in msg
        if rank == n - 1:
            assert "param_groups[1]['params'][1] (flat index 2), shape (5,)" in msg
        kind, msg = res["shape"]
        assert kind == "ValueError", res["shape"]
        assert "parameter shapes or dtypes differ between ranks" in msg
        assert "first mismatch at param_groups[0]['params'][0] (flat index 0)" in msg
