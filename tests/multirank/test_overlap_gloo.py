"""OnebitAdam(overlap=True) runs bucket work on a communication thread, bit-identical to off.

Each rank trains two copies of a model on the same batches, one with overlap on and one with it
off, and compares parameters after every step (warmup and compression) and all state at the end.
The collectives of the overlapped copy are recorded with the thread that issued them: during
backward they run on the optimizer's communication thread, in the exchange order.
"""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch

import commopt
from tests.multirank.harness import run_ranks

TIMEOUT = 240
FREEZE = 3
STEPS = 8


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _state(opt) -> list[torch.Tensor]:
    out = []
    for s in opt.flat_states:
        out += [v.clone() for _, v in sorted(s.flat.items())]
        out += [v.clone() for v in s.comm.values()]
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
):
    """``sync_every_pass``: accumulate ``micro`` passes without ``no_sync()`` (each pass
    communicates again; the last one wins). ``record``: log the overlapped copy's collectives."""
    warnings.simplefilter("ignore")
    recorder = _Recorder(backend) if record else None
    torch.manual_seed(0)
    base = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8), torch.nn.Linear(8, 3)
    )
    models = [base, copy.deepcopy(base)]
    opts = [
        commopt.OnebitAdam(
            m.parameters(),
            lr=0.02,
            freeze_step=FREEZE,
            weight_decay=0.01,
            overlap=on,
            backend=recorder if (on and recorder is not None) else backend,
        )
        for m, on in zip(models, (True, False), strict=True)
    ]
    for opt in opts:
        if opt_bucket is not None:
            opt._bucket_numel = opt_bucket
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
                    if opt._overlap:
                        calls_in_no_sync.append((backend.stats - before).calls)
                else:
                    torch.nn.functional.mse_loss(model(x), y).div(micro).backward()
            if opt._overlap:
                saved = (_flat(model).clone(), _state(opt))
                stats = opt.comm_stats()
            opt.step()
            if opt._overlap:
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
        ),
        "replicas": everyone.view(backend.world_size, -1),
        "calls_in_no_sync": calls_in_no_sync,
        "full_in_step": full_in_step,
        "compressed_in_step": compressed_in_step,
        "untouched": untouched,
        "skipped": [o.comm_stats()["skipped_steps"] for o in opts],
        "log": recorder.log if recorder is not None else None,
        "buckets": [s.bucket.numel for s in opts[0].flat_states],
        "exchange_order": opts[0].early_work.exchange_order,
    }


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("opt_bucket", [None, 100], ids=["one-bucket", "several-buckets"])
def test_overlap_equals_no_overlap_every_step(opt_bucket, world_size):
    results = run_ranks(_train, world_size, opt_bucket, 1, 0, timeout=TIMEOUT)
    for r in results:
        assert r["same"] == [True] * STEPS, r["same"]
        assert r["states_equal"]
        for replica in r["replicas"][1:]:
            assert torch.equal(r["replicas"][0], replica)
        # all bucket work was started during backward: step() averaged and compressed nothing
        assert r["full_in_step"] == [0] * STEPS
        assert r["compressed_in_step"] == [0] * STEPS


def test_overlap_no_sync_accumulation():
    for r in run_ranks(_train, 2, 100, 3, 0, timeout=TIMEOUT):
        assert r["calls_in_no_sync"] == [0] * (2 * STEPS)
        assert r["same"] == [True] * STEPS, r["same"]
        assert r["states_equal"]


@pytest.mark.parametrize("bad_step", [2, 6], ids=["warmup", "compression"])
def test_overlap_nonfinite_gradient_skips_everywhere_untouched(bad_step):
    for r in run_ranks(_train, 2, 100, 1, bad_step, timeout=TIMEOUT):
        assert r["untouched"] is True
        assert r["skipped"] == [1, 1]
        assert r["same"] == [True] * STEPS, r["same"]
        assert r["states_equal"]


def test_overlap_second_synced_backward_equals_no_overlap():
    """Two passes per step without no_sync(): every bucket is exchanged twice (a second round of
    tickets), the last one wins, and the result is still overlap=False's, bit for bit."""
    for r in run_ranks(_train, 2, 100, 2, 0, True, timeout=TIMEOUT):
        assert r["same"] == [True] * STEPS, r["same"]
        assert r["states_equal"]
        assert r["skipped"] == [0, 0]


def test_overlap_collectives_run_on_the_thread_in_exchange_order():
    results = run_ranks(_train, 2, 100, 1, 0, False, True, timeout=TIMEOUT)
    for r in results:
        assert r["same"] == [True] * STEPS, r["same"]
        buckets = r["buckets"]
        assert len(buckets) > 2  # several buckets, so there is an order to keep
        # gradients become ready from the last layer back: the last bucket goes first
        assert r["exchange_order"] == list(reversed(range(len(buckets))))
        thread = [(op, n) for who, op, n in r["log"] if who.startswith("commopt-")]
        # per step, one bucket-sized op first per bucket (warmup: the average; compression:
        # the exchange's first all_to_all of a padded bucket), in exchange order
        averages = [n for op, n in thread if op in ("all_reduce", "all_reduce_async")]
        in_order = [buckets[b] for b in r["exchange_order"]]
        assert averages[: len(buckets) * FREEZE] == in_order * FREEZE
        # the compression stage's exchanges all ran on the thread too
        assert sum(op == "all_to_all" for op, _ in thread) == len(buckets) * (STEPS - FREEZE)
        # ... and the main thread's only collectives are step()'s agreement and the order fix
        main = [(op, n) for who, op, n in r["log"] if not who.startswith("commopt-")]
        assert {op for op, _ in main} <= {"all_reduce", "broadcast"}
        assert sum(op == "broadcast" for op, _ in main) == 1
        assert all(n < 16 for op, n in main if op == "all_reduce"), main
    assert results[0]["log"] == results[1]["log"]  # same collectives, same order, same threads


class _Broken(RuntimeError):
    pass


def _failing(backend, fail_step: int, bad_rank: int | None):
    """The communication thread's exchange raises at ``fail_step`` (on ``bad_rank`` only, or
    on every rank): step() must raise it on the main thread, and the optimizer goes on."""
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = commopt.OnebitAdam(model.parameters(), lr=0.02, freeze_step=2, overlap=True)
    opt._bucket_numel = 50
    compress = opt._compress
    seen = []

    def broken(*args, **kwargs):
        if opt.global_state["step"] + 1 == fail_step and bad_rank in (None, backend.rank):
            raise _Broken(f"injected on {threading.current_thread().name}")
        return compress(*args, **kwargs)

    opt._compress = broken
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
    return seen, opt.early_work._thread.idle


def test_overlap_thread_error_surfaces_in_step():
    for seen, idle in run_ranks(_failing, 2, 4, None, timeout=TIMEOUT):
        assert seen[:3] == ["ok"] * 3
        assert seen[3] == "injected on commopt-OnebitAdam"  # raised by step(), not lost
        assert seen[4] == "ok"  # the next step runs: the error was cleared
        assert idle
