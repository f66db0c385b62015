"""overlap=True runs bucket work on a communication thread, bit-identical to overlap=False.

Each rank trains two copies of a model on the same batches, one with overlap on and one with it
off, and compares parameters after every step (every phase) and all state at the end, for each
optimizer: 1-bit Adam (warmup 1-3, compression 4-8), 1-bit LAMB (warmup 1-3, σ frozen at 4,
compression 4-8) and 0/1 Adam (variance steps 1, 2, 4 and 1-bit steps 3, 5 during backward;
phase B: sync 6, local 7, sync 8, the syncs staged during backward too). The collectives of the
overlapped copy are recorded with the thread that issued them: during backward they run on the
optimizer's communication thread, in the exchange order.
"""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch

import commopt
from tests.multirank.harness import run_ranks
from tests.optim_registry import BY_NAME, MODES, OPTIMIZERS

TIMEOUT = 240
FREEZE = 3
STEPS = 8
NAMES = [info.name for info in OPTIMIZERS]
#: 0/1 Adam's phase-B sync steps (with overlap on, staged during backward too)
SYNC_STEPS = (6, 8)


def _make(name: str, params, backend, overlap: bool, bucket_numel: int | None, **extra):
    """The registry's backward-time config, standalone or with overlap (``extra`` wins)."""
    mode = "overlap" if overlap else "standalone"
    kw = dict(bucket_numel=bucket_numel, backend=backend, **extra)
    return BY_NAME[name].make(params, mode=mode, backward=True, **kw)


def _compressed_in_step(name: str, buckets: int) -> list[int]:
    """The compressed exchanges step() itself runs with overlap on, per step: none (0/1
    Adam's syncs are staged during backward too)."""
    del name, buckets
    return [0] * STEPS


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8), torch.nn.Linear(8, 3)
    )


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _state(opt) -> list[torch.Tensor]:
    """Every flat buffer (m, v, 1-bit LAMB's v_f, 0/1 Adam's p_sync), per-tensor scalar (σ, c̄,
    f^last, c) and error buffer."""
    out = []
    for s in opt.flat_states:
        out += [v.clone() for _, v in sorted(s.flat.items())]
        out += [v.clone() for _, v in sorted(s.scalars.items())]
        out += [v.clone() for _, v in sorted(s.comm.items())]
    return out


class _Recorder:
    """Wraps a backend: logs (thread name, op, numel) of every collective."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.log: list[tuple[str, str, int]] = []

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if name in ("all_reduce", "all_reduce_async", "all_gather", "all_to_all", "broadcast"):

            def call(t, *args, **kwargs):
                self.log.append((threading.current_thread().name, name, t.numel()))
                return attr(t, *args, **kwargs)

            return call
        return attr


def _train(
    backend,
    opt_bucket: int | None,
    micro: int,
    bad_step: int,
    sync_every_pass: bool = False,
    record: bool = False,
    name: str = "OnebitAdam",
    extra: dict | None = None,
):
    """``sync_every_pass``: accumulate ``micro`` passes without ``no_sync()`` (each pass
    communicates again; the last one wins). ``record``: log the overlapped copy's collectives.
    ``extra``: more constructor arguments for both copies (``trust_ratio``, ``error_feedback``);
    its ``"change_at"``: (step, key, value) set in every param group of both copies between
    that step's backward and its step()."""
    warnings.simplefilter("ignore")
    extra = dict(extra or {})
    change = extra.pop("change_at", (0, None, None))
    recorder = _Recorder(backend) if record else None
    base = _model()
    models = [base, copy.deepcopy(base)]
    opts = [
        _make(
            name,
            m.parameters(),
            recorder if (on and recorder is not None) else backend,
            on,
            opt_bucket,
            **extra,
        )
        for m, on in zip(models, (True, False), strict=True)
    ]
    same, calls_in_no_sync, full_in_step, compressed_in_step, untouched = [], [], [], [], None
    for step in range(1, STEPS + 1):
        for model, opt in zip(models, opts, strict=True):
            opt.zero_grad()
            for k in range(micro):
                g = torch.Generator().manual_seed(1000 * step + 10 * backend.rank + k)
                x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
                if step == bad_step and backend.rank == 1:
                    x[0, 0] = float("inf")
                before = backend.stats.snapshot()
                if k < micro - 1 and not sync_every_pass:
                    with opt.no_sync():
                        torch.nn.functional.mse_loss(model(x), y).div(micro).backward()
                    if opt.overlap:
                        calls_in_no_sync.append((backend.stats - before).calls)
                else:
                    torch.nn.functional.mse_loss(model(x), y).div(micro).backward()
            if step == change[0]:
                for group in opt.param_groups:
                    group[change[1]] = change[2]
            if opt.overlap:
                saved = (_flat(model).clone(), _state(opt))
                stats = opt.comm_stats()
            opt.step()
            if opt.overlap:
                after = opt.comm_stats()
                full_in_step.append(after["full_precision_rounds"] - stats["full_precision_rounds"])
                compressed_in_step.append(after["compressed_rounds"] - stats["compressed_rounds"])
                if step == bad_step:
                    untouched = torch.equal(saved[0], _flat(model)) and all(
                        torch.equal(a, b) for a, b in zip(saved[1], _state(opt), strict=True)
                    )
        same.append(torch.equal(_flat(models[0]), _flat(models[1])))
    flat = _flat(models[0])
    everyone = torch.empty(backend.world_size * flat.numel())
    backend.all_gather(everyone, flat)
    return {
        "same": same,
        "states_equal": all(
            torch.equal(a, b) for a, b in zip(_state(opts[0]), _state(opts[1]), strict=True)
        )
        and opts[0].global_state == opts[1].global_state,
        "replicas": everyone.view(backend.world_size, -1),
        "calls_in_no_sync": calls_in_no_sync,
        "full_in_step": full_in_step,
        "compressed_in_step": compressed_in_step,
        "untouched": untouched,
        "skipped": [o.comm_stats()["skipped_steps"] for o in opts],
        "log": recorder.log if recorder is not None else None,
        "buckets": [s.bucket.numel for s in opts[0].flat_states],
        "exchange_order": opts[0].early_work.exchange_order,
        "exchange": opts[0].exchange.name,
    }


def _check_equal(results, name: str) -> None:
    """Bit-identical to overlap=False after every step and in all state at the end, identical
    replicas (every run ends on a step that communicates), and every exchange that can start
    during backward did: step() averaged nothing and compressed only 0/1 Adam's syncs."""
    for r in results:
        assert r["same"] == [True] * STEPS, r["same"]
        assert r["states_equal"]
        for replica in r["replicas"][1:]:
            assert torch.equal(r["replicas"][0], replica)
        assert r["full_in_step"] == [0] * STEPS
        assert r["compressed_in_step"] == _compressed_in_step(name, len(r["buckets"]))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("opt_bucket", [None, 100], ids=["one-bucket", "several-buckets"])
def test_overlap_equals_no_overlap_every_step(opt_bucket, world_size, name):
    results = run_ranks(_train, world_size, opt_bucket, 1, 0, False, False, name, timeout=TIMEOUT)
    _check_equal(results, name)
    assert len(results[0]["buckets"]) == (1 if opt_bucket is None else 4)


#: every optimizer with EControl, and each with its registry options
WITH_OPTIONS = [(i.name, MODES["econtrol"]) for i in OPTIMIZERS] + [
    (i.name, option) for i in OPTIMIZERS for option in i.options
]


@pytest.mark.parametrize(
    ("name", "extra"),
    WITH_OPTIONS,
    ids=[f"{n}-{','.join(f'{k}={v}' for k, v in o.items())}" for n, o in WITH_OPTIONS],
)
def test_overlap_with_options_equals_no_overlap(name, extra):
    # EControl's state (h, e) is staged like the classic error buffers; "tracking" changes only
    # what step() does after the exchange.
    results = run_ranks(_train, 2, 100, 1, 0, False, False, name, extra, timeout=TIMEOUT)
    _check_equal(results, name)


@pytest.mark.parametrize(
    ("step", "key", "value"),
    [(6, "lr", 0.01), (8, "lr", 0.03), (8, "weight_decay", 0.0), (8, "betas", (0.8, 0.99))],
    ids=["first-sync-lr", "sync-lr", "sync-weight-decay", "sync-betas"],
)
def test_overlap_zero_one_sync_with_hyperparameters_changed_after_backward(step, key, value):
    # The sync was staged during backward with the old value: step() sees the change, drops the
    # staged work and syncs again (its compressed exchanges); unchanged, nothing is redone.
    change = {"change_at": (step, key, value)}
    results = run_ranks(_train, 2, 100, 1, 0, False, False, "ZeroOneAdam", change, timeout=TIMEOUT)
    for r in results:
        assert r["same"] == [True] * STEPS, r["same"]
        assert r["states_equal"]
        assert torch.equal(r["replicas"][0], r["replicas"][1])
        expected = [0] * STEPS
        expected[step - 1] = len(r["buckets"])
        assert r["compressed_in_step"] == expected


def _train_two_nodes(backend, name: str):
    """:func:`_train` with ``topology="hierarchical"`` on 2 faked nodes × 2 ranks."""
    import os

    os.environ.update(
        LOCAL_RANK=str(backend.rank % 2), LOCAL_WORLD_SIZE="2", GROUP_RANK=str(backend.rank // 2)
    )
    return _train(backend, 100, 1, 0, False, False, name, {"topology": "hierarchical"})


@pytest.mark.parametrize("name", NAMES)
def test_overlap_with_the_hierarchical_exchange_equals_no_overlap(name):
    # The hierarchical exchange's collectives (node and cross groups) run on the thread too.
    results = run_ranks(_train_two_nodes, 4, name, timeout=TIMEOUT)
    assert [r["exchange"] for r in results] == [
        f"hierarchical:2x2:{i}.{j}" for i in (0, 1) for j in (0, 1)
    ]
    _check_equal(results, name)


@pytest.mark.parametrize("name", NAMES)
def test_overlap_no_sync_accumulation(name):
    for r in run_ranks(_train, 2, 100, 3, 0, False, False, name, timeout=TIMEOUT):
        assert r["calls_in_no_sync"] == [0] * (2 * STEPS)
        assert r["same"] == [True] * STEPS, r["same"]
        assert r["states_equal"]


#: (optimizer, step, phase): the first step of each phase that communicates
PHASE_STARTS = [
    (i.name, step, phase) for i in OPTIMIZERS for step, phase in i.phase_starts(STEPS, True)
]


@pytest.mark.parametrize(
    ("name", "bad_step", "phase"), PHASE_STARTS, ids=[f"{n}-{ph}" for n, _, ph in PHASE_STARTS]
)
def test_overlap_nonfinite_gradient_skips_everywhere_untouched(name, bad_step, phase):
    # Several buckets: those without the inf are exchanged during backward, and must be dropped,
    # not committed (1-bit LAMB at step 4: nor σ frozen).
    del phase
    for r in run_ranks(_train, 2, 100, 1, bad_step, False, False, name, timeout=TIMEOUT):
        assert r["untouched"] is True
        assert r["skipped"] == [1, 1]
        assert r["same"] == [True] * STEPS, r["same"]
        assert r["states_equal"]


@pytest.mark.parametrize("name", NAMES)
def test_overlap_second_synced_backward_equals_no_overlap(name):
    """Two passes per step without no_sync(): every bucket is exchanged twice (a second round of
    tickets), the last one wins, and the result is still overlap=False's, bit for bit."""
    for r in run_ranks(_train, 2, 100, 2, 0, True, False, name, timeout=TIMEOUT):
        assert r["same"] == [True] * STEPS, r["same"]
        assert r["states_equal"]
        assert r["skipped"] == [0, 0]


def _phases(name: str) -> tuple[int, int, int]:
    """(full-precision steps, 1-bit steps during backward, syncs in step()) of the registry's
    backward-time schedule: with overlap on, 0/1 Adam's syncs are staged during backward too."""
    phases = BY_NAME[name].phases(STEPS, backward=True)
    averaged = sum(len(ph.steps) for ph in phases if ph.updates_variance)
    exchanged = sum(len(ph.steps) for ph in phases if ph.communicates and not ph.updates_variance)
    return averaged, exchanged, 0


@pytest.mark.parametrize("name", NAMES)
def test_overlap_collectives_run_on_the_thread_in_exchange_order(name):
    results = run_ranks(_train, 2, 100, 1, 0, False, True, name, timeout=TIMEOUT)
    averaged, exchanged, synced = _phases(name)
    for r in results:
        assert r["same"] == [True] * STEPS, r["same"]
        buckets = r["buckets"]
        assert len(buckets) > 2  # several buckets, so there is an order to keep
        # gradients become ready from the last layer back: the last bucket goes first
        assert r["exchange_order"] == list(reversed(range(len(buckets))))
        thread = [(op, n) for who, op, n in r["log"] if who.startswith("commopt-")]
        # per full-precision step, one average per bucket, in exchange order (the classic
        # exchange has no all_reduce)
        averages = [n for op, n in thread if op in ("all_reduce", "all_reduce_async")]
        in_order = [buckets[b] for b in r["exchange_order"]]
        assert averages == in_order * averaged
        # the 1-bit exchanges started during backward all ran on the thread (one all_to_all
        # each) ...
        assert sum(op == "all_to_all" for op, _ in thread) == len(buckets) * exchanged
        # ... and the main thread's only collectives are step()'s agreement, the order fix and
        # 0/1 Adam's syncs
        main = [(op, n) for who, op, n in r["log"] if not who.startswith("commopt-")]
        assert sum(op == "broadcast" for op, _ in main) == 1
        assert all(n < 16 for op, n in main if op == "all_reduce"), main
        assert sum(op == "all_to_all" for op, _ in main) == len(buckets) * synced
        if not synced:
            assert {op for op, _ in main} <= {"all_reduce", "broadcast"}
    assert results[0]["log"] == results[1]["log"]  # same collectives, same order, same threads


def _resume(backend, name: str, split: int):
    """overlap=True, saved after step ``split`` and loaded into a new model and a new
    optimizer with overlap=True, against overlap=False straight through: per step, whether
    parameters and every state buffer (error buffers included) are the same bits."""
    warnings.simplefilter("ignore")
    ref_model = _model()
    ref = _make(name, ref_model.parameters(), backend, False, 100)
    model = copy.deepcopy(ref_model)
    opt = _make(name, model.parameters(), backend, True, 100)
    same = []
    for step in range(1, STEPS + 1):
        if step == split + 1:  # each rank saves and restores its own model and optimizer
            saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
            model = _model()
            model.load_state_dict(saved[0])
            opt = _make(name, model.parameters(), backend, True, 100)
            opt.load_state_dict(saved[1])
        g = torch.Generator().manual_seed(1000 * step + 10 * backend.rank)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
        same.append(
            torch.equal(_flat(model), _flat(ref_model))
            and all(torch.equal(a, b) for a, b in zip(_state(opt), _state(ref), strict=True))
            and opt.global_state == ref.global_state
        )
    return same, opt.comm_stats()["compressed_rounds"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("split", [3, 4, 6])
def test_overlap_resume_from_state_dict_equals_no_overlap(split, name):
    # 3: 1-bit Adam resumes into its first compression step, 1-bit LAMB freezes σ during the
    # first backward after the load; 4: the error buffers come from the checkpoint; 6: 0/1
    # Adam resumes after its first sync (p_sync, s from the checkpoint) into a staged one.
    for same, compressed in run_ranks(_resume, 2, name, split, timeout=TIMEOUT):
        assert same == [True] * STEPS, same
        assert compressed > 0  # the resumed optimizer did exchange at one bit


class _Broken(RuntimeError):
    pass


def _failing(backend, fail_step: int, bad_rank: int | None):
    """The communication thread's exchange raises at ``fail_step`` (on ``bad_rank`` only, or
    on every rank): step() must raise it on the main thread, and the optimizer goes on."""
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    params = model.parameters()
    opt = commopt.OnebitAdam(params, lr=0.02, freeze_step=2, overlap=True, bucket_numel=50)
    ops = opt._ops  # every exchange, in step() and on the thread, goes through it
    compress = ops.exchange
    seen = []

    def broken(*args, **kwargs):
        if opt.global_state["step"] + 1 == fail_step and bad_rank in (None, backend.rank):
            raise _Broken(f"injected on {threading.current_thread().name}")
        return compress(*args, **kwargs)

    ops.exchange = broken
    for step in range(1, 6):
        g = torch.Generator().manual_seed(step + 10 * backend.rank)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        try:
            opt.step()
            seen.append("ok")
        except _Broken as err:
            seen.append(str(err))
            opt.global_state["step"] += 1  # as a user who skips the batch would
    return seen, opt.early_work.thread.idle


def test_overlap_thread_error_surfaces_in_step():
    for seen, idle in run_ranks(_failing, 2, 4, None, timeout=TIMEOUT):
        assert seen[:3] == ["ok"] * 3
        assert seen[3] == "injected on commopt-OnebitAdam"  # raised by step(), not lost
        assert seen[4] == "ok"  # the next step runs: the error was cleared
        assert idle


def _train_mixed_dtype(backend):
    """0/1 Adam with one bf16 layer (buckets of its own): per step, bit-identical to
    overlap=False, and the 1-bit exchanges (all_to_all) the main thread ran."""
    warnings.simplefilter("ignore")
    recorder = _Recorder(backend)
    base = _model()
    base[2].to(torch.bfloat16)
    models = [base, copy.deepcopy(base)]
    opts = [
        _make("ZeroOneAdam", models[0].parameters(), recorder, True, 100),
        _make("ZeroOneAdam", models[1].parameters(), backend, False, 100),
    ]
    same, in_step = [], []
    for step in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(1000 * step + 10 * backend.rank)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        for m, o in zip(models, opts, strict=True):
            o.zero_grad()
            h = m[2](m[1](m[0](x)).to(torch.bfloat16)).float()
            torch.nn.functional.mse_loss(m[3](h), y).backward()
            o.step()
        main = [op for who, op, _ in recorder.log if not who.startswith("commopt-")]
        in_step.append(main.count("all_to_all"))
        recorder.log.clear()
        same.append(torch.equal(_flat(models[0]).float(), _flat(models[1]).float()))
    dtypes = [s.bucket.params[0].dtype for s in opts[0].flat_states]
    return same, in_step, dtypes


def test_overlap_zero_one_sync_with_a_bf16_bucket():
    # The fp32 buckets' syncs are staged during backward; the bf16 bucket's p' needs the master
    # weights step() swaps in, so step() stages it (its exchange on the main thread) and
    # commits it with the others.
    for same, in_step, dtypes in run_ranks(_train_mixed_dtype, 2, timeout=TIMEOUT):
        assert same == [True] * STEPS, same
        low = dtypes.count(torch.bfloat16)
        assert 0 < low < len(dtypes)
        assert in_step == [low if s in SYNC_STEPS else 0 for s in range(1, STEPS + 1)]
