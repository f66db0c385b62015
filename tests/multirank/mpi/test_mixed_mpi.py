"""MixedBackend over gloo (TorchBackend) and MPI in the one mpiexec job.

Inputs are small integers (exact in every float type and in any summation order), so a sum is
the same bit for bit whichever library reduced it, and each result can be checked against a
reference computed locally from the input formula.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import tempfile

import pytest
import torch

from commopt import OnebitAdam
from commopt.cli import tune
from commopt.comm import MixedBackend, MpiBackend, TorchBackend, resolve_backend
from commopt.comm.table import SelectionTable, canonical_json


def rule(op, lo, hi, backend, dtype="*"):
    return {"op": op, "dtype": dtype, "min_bytes": lo, "max_bytes": hi, "backend": backend}


def table(default: str, rules: list[dict]) -> dict:
    return {"format": "commopt-selection-table", "version": 1, "default": default, "rules": rules}


# Borders chosen so the sizes drawn below land on both sides of each, for every op.
TABLE = table(
    "mpi",
    [
        rule("all_reduce", 0, 256, "torch"),
        rule("all_reduce", 256, 4096, "mpi"),
        rule("all_reduce", 4096, None, "torch"),
        rule("all_reduce", 0, 1000, "mpi", dtype="bfloat16"),
        rule("all_reduce", 1000, None, "torch", dtype="bfloat16"),
        rule("all_gather", 0, 512, "mpi"),
        rule("all_gather", 512, None, "torch"),
        rule("all_to_all", 0, 2048, "torch"),
        rule("all_to_all", 2048, None, "mpi"),
        rule("broadcast", 0, 300, "mpi"),
        rule("broadcast", 300, None, "torch"),
        rule("barrier", 0, None, "torch"),
    ],
)
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64]


def value(rank: int, i: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers depending on (rank, call, position): exact in every dtype used."""
    base = torch.arange(numel, dtype=torch.int64) * 7 + 13 * i + 101 * rank
    return (base % 61 - 30).to(dtype)


def plan(length: int, n: int) -> list[tuple[str, torch.dtype, int]]:
    """The same random sequence of (op, dtype, element count) on every rank."""
    rnd = random.Random(2024)
    ops = ["all_reduce", "all_gather", "all_to_all", "broadcast", "barrier"]
    seq = []
    for _ in range(length):
        op = rnd.choice(ops)
        dtype = rnd.choice(DTYPES)
        numel = n * rnd.choice([1, 3, 16, 40, 100, 257, 700, 2000])
        seq.append((op, dtype, numel))
    return seq


def run_sequence(be, rank: int, n: int, seq) -> list[torch.Tensor]:
    outs = []
    for i, (op, dtype, numel) in enumerate(seq):
        t = value(rank, i, numel, dtype)
        if op == "all_reduce":
            outs.append(be.all_reduce(t, "sum" if i % 3 else "max"))
        elif op == "all_gather":
            out = torch.empty(n * numel, dtype=dtype)
            outs.append(be.all_gather(out, t))
        elif op == "all_to_all":
            out = torch.empty(numel, dtype=dtype)
            outs.append(be.all_to_all(out, t))
        elif op == "broadcast":
            outs.append(be.broadcast(t, src=i % n))
        else:
            be.barrier()
            outs.append(torch.zeros(0))
    return outs


def expected(rank: int, n: int, seq) -> list[torch.Tensor]:
    """What each call must return, from the input formula alone."""
    outs = []
    for i, (op, dtype, numel) in enumerate(seq):
        every = [value(r, i, numel, dtype) for r in range(n)]
        if op == "all_reduce":
            stacked = torch.stack([e.double() for e in every])
            red = stacked.sum(0) if i % 3 else stacked.max(0).values
            outs.append(red.to(dtype))
        elif op == "all_gather":
            outs.append(torch.cat(every))
        elif op == "all_to_all":
            k = numel // n
            outs.append(torch.cat([every[j][rank * k : (rank + 1) * k] for j in range(n)]))
        elif op == "broadcast":
            outs.append(every[i % n])
        else:
            outs.append(torch.zeros(0))
    return outs


def test_long_interleaved_sequence_equals_single_backends(
    torch_backend: TorchBackend, mpi_backend: MpiBackend, world, allgather
) -> None:
    rank, n = world
    seq = plan(400, n)
    mixed = MixedBackend({"torch": torch_backend, "mpi": mpi_backend}, TABLE)
    before = {k: b.stats.snapshot() for k, b in mixed.backends.items()}
    via_mixed = run_sequence(mixed, rank, n, seq)
    spent = {k: (b.stats - before[k]).calls for k, b in mixed.backends.items()}
    via_torch = run_sequence(torch_backend, rank, n, seq)
    via_mpi = run_sequence(mpi_backend, rank, n, seq)
    switches = allgather(mixed.switches)

    ref = expected(rank, n, seq)
    for i, (a, b, c, r) in enumerate(zip(via_mixed, via_torch, via_mpi, ref, strict=True)):
        what = f"rank {rank}, call {i} {seq[i]}"
        assert a.dtype == r.dtype and torch.equal(a, r), f"mixed result wrong at {what}"
        assert torch.equal(b, r), f"torch result wrong at {what}"
        assert torch.equal(c, r), f"mpi result wrong at {what}"
    assert len(set(switches)) == 1, f"ranks switched backends differently: {switches}"
    assert switches[0] >= 150, f"only {switches[0]} switches: the sequence does not interleave"
    assert mixed.stats.calls == len(seq)
    assert spent["torch"] + spent["mpi"] == len(seq)
    assert spent == {k: mixed.calls_by_backend[k] for k in spent}
    assert min(spent.values()) > 100


def test_rank_with_a_different_table_gets_rank0s(
    torch_backend, mpi_backend, world, allgather, caplog
) -> None:
    rank, n = world
    mine = json.loads(json.dumps(TABLE))
    if rank == n - 1:  # this rank loaded a stale table: everything to torch
        mine["rules"] = [rule("all_reduce", 0, None, "torch")]
        mine["default"] = "torch"
    with caplog.at_level(logging.WARNING, logger="commopt.comm.mixed"):
        mixed = MixedBackend([torch_backend, mpi_backend], mine)
    agreed = allgather(canonical_json(mixed.table))
    corrected = allgather(mixed.corrected)
    picks = allgather([mixed.select("all_reduce", s, torch.float32) for s in (10, 1000, 10**6)])

    assert set(agreed) == {canonical_json(TABLE)}
    assert corrected == [False] * (n - 1) + [True]
    assert picks == [["torch", "mpi", "torch"]] * n
    warned = [r.getMessage() for r in caplog.records if "differs from rank 0's" in r.getMessage()]
    assert bool(warned) == (rank == n - 1), warned


def test_rank0_bad_table_fails_on_every_rank_alike(torch_backend, mpi_backend, world, allgather):
    rank = world[0]
    bad = json.loads(json.dumps(TABLE))
    bad["rules"][1]["min_bytes"] = 300  # gap [256, 300) in all_reduce
    errors = []
    with tempfile.TemporaryDirectory() as tmp:  # a directory, and a table nested too deeply
        deep = os.path.join(tmp, "deep.json")
        with open(deep, "w") as f:
            f.write("[" * 100_000 + "]" * 100_000)
        rank0 = (bad, "/nonexistent/table.json", tmp, deep)
        # MPI first: a rank left waiting in an MPI broadcast never times out (issue #41.4)
        for tbl in rank0:
            try:
                MixedBackend(
                    {"mpi": mpi_backend, "torch": torch_backend}, tbl if rank == 0 else TABLE
                )
                errors.append(None)
            except ValueError as err:
                errors.append(str(err))
    everyone = allgather(errors)
    assert all(e == everyone[0] for e in everyone), everyone
    assert "gap" in everyone[0][0] and "[256, 300)" in everyone[0][0]
    assert "rank 0 could not load" in everyone[0][1] and "does not exist" in everyone[0][1]
    assert "rank 0 could not load" in everyone[0][2] and "Is a directory" in everyone[0][2]
    assert "rank 0 could not load" in everyone[0][3] and "nested too deeply" in everyone[0][3]


#: large messages to MPI, small ones to gloo: every step switches several times
SWITCHING = table(
    "torch",
    [
        rule("all_reduce", 0, 1024, "torch"),
        rule("all_reduce", 1024, None, "mpi"),
        rule("all_gather", 0, 64, "torch"),
        rule("all_gather", 64, None, "mpi"),
        rule("all_to_all", 0, None, "mpi"),
    ],
)


def train(backend, rank: int, steps: int = 8, freeze: int = 4) -> list[torch.Tensor]:
    shapes = [(64, 33), (33,), (4096,), (3, 5, 7)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    opt = OnebitAdam(params, lr=1e-2, freeze_step=freeze, backend=backend)
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        for p in params:
            # Multiples of 1/64 in [-1, 1]: sums of n of them are exact in any order.
            p.grad = torch.randint(-64, 65, p.shape, generator=g).float() / 64
        opt.step()
    return [p.detach().clone() for p in params]


def test_onebit_adam_through_mixed_equals_single_backend(
    torch_backend, mpi_backend, world, allgather
) -> None:
    rank = world[0]
    mixed = MixedBackend({"torch": torch_backend, "mpi": mpi_backend}, SWITCHING)
    via_mixed = train(mixed, rank)
    via_torch = train(torch_backend, rank)
    via_mpi = train(mpi_backend, rank)
    everyone = allgather(via_mixed)
    used = dict(mixed.calls_by_backend)

    for i, (a, b, c) in enumerate(zip(via_mixed, via_torch, via_mpi, strict=True)):
        assert torch.equal(a, b), f"rank {rank}: param {i} differs between mixed and torch"
        assert torch.equal(a, c), f"rank {rank}: param {i} differs between mixed and mpi"
    for r, theirs in enumerate(everyone):
        assert all(torch.equal(a, b) for a, b in zip(via_mixed, theirs, strict=True)), r
    assert used["torch"] > 0 and used["mpi"] > 0 and mixed.switches > 8, used
    assert via_mixed[2].abs().sum() > 0  # it trained


def test_tune_writes_a_table_mixed_backend_loads(
    torch_backend, mpi_backend, world, allgather, tmp_path
) -> None:
    rank, n = world
    path = allgather(str(tmp_path / "table.json"))[0]  # rank 0's path for everyone
    args = "--min-bytes 1K --max-bytes 16K --factor 4 --reps 1 --warmup 0 --no-progress"
    args += " --ops all_reduce,all_to_all,compressed_allreduce --reduce-dtypes float32"
    status = tune.main(["-o", path, *args.split()])
    mixed = MixedBackend({"torch": torch_backend, "mpi": mpi_backend}, path)
    via_path = MixedBackend.from_table(path)  # over every available backend
    with pytest.raises(TypeError, match=r"MixedBackend\.from_table"):
        resolve_backend(path)  # a path is not a backend: no hidden collective
    t = torch.full((300,), float(rank))
    via_path.all_reduce(t)
    loaded = allgather(canonical_json(mixed.table))

    assert status == 0
    assert len(set(loaded)) == 1
    tbl = mixed.table
    assert tbl["world_size"] == n and set(tbl["backends"]) == {"torch", "mpi"}
    SelectionTable(tbl, available={"torch", "mpi"})
    times = tbl["measurements"]["times"]
    assert set(times) == {
        "all_reduce/float32",
        "all_to_all/float32",
        "compressed_allreduce/float32",
    }
    for key, per in times.items():
        want = {"torch", "mpi", "mixed"} if key.startswith("compressed") else {"torch", "mpi"}
        assert set(per) == want
        assert all(len(v) == 3 and all(x > 0 for x in v) for v in per.values())
    # The rules pick the faster backend at each measured size.
    for key in ("all_reduce/float32", "all_to_all/float32"):
        op = key.split("/")[0]
        for i, size in enumerate(tbl["measurements"]["sizes"][key]):
            chosen = mixed.select(op, size, torch.float32)
            other = ({"torch", "mpi"} - {chosen}).pop()
            margin = 1 + tbl["measurements"]["tie_margin"]
            assert times[key][chosen][i] <= times[key][other][i] * margin, (key, size)
    assert isinstance(via_path, MixedBackend)
    assert torch.equal(t, torch.full((300,), float(sum(range(n)))))


@pytest.mark.parametrize("n_ops", [50])
def test_mixed_backend_with_one_child_is_that_child(mpi_backend, world, n_ops) -> None:
    rank, n = world
    tbl = {"format": "commopt-selection-table", "version": 1, "default": "mpi", "rules": []}
    mixed = MixedBackend([mpi_backend], tbl)
    seq = plan(n_ops, n)
    got = run_sequence(mixed, rank, n, seq)
    for a, r in zip(got, expected(rank, n, seq), strict=True):
        assert torch.equal(a, r)
    assert mixed.switches == 0 and mixed.calls_by_backend == {"mpi": n_ops}


def _train_with_backward(backend, rank: int, overlap: bool) -> list[torch.Tensor]:
    """1-bit Adam on a small MLP with real backward passes (so that ``overlap=True`` starts
    exchanges on its thread) and an all-reduce of the loss between backward and ``step()``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    opt = OnebitAdam(
        model.parameters(),
        lr=1e-2,
        freeze_step=3,
        backend=backend,
        overlap=overlap,
        bucket_numel=600,
    )
    for step in range(8):
        g = torch.Generator().manual_seed(1000 * step + rank)
        loss = model(torch.randn(8, 16, generator=g)).square().mean()
        loss.backward()
        backend.all_reduce(loss.detach().reshape(1).clone(), "avg")  # the program's own
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_overlap_through_mixed_has_channels_and_equals_no_overlap(
    torch_backend, mpi_backend, world, allgather
) -> None:
    """MixedBackend opens the thread's channel on each backend it routes to (a new group on
    gloo, a ``Dup`` on MPI), so ``overlap=True`` runs beside ``step()``'s own collectives and
    the program's; before, it could not open one, and the optimizer refuses overlap there."""
    rank = world[0]
    mixed = MixedBackend({"torch": torch_backend, "mpi": mpi_backend}, SWITCHING)
    overlapped = _train_with_backward(mixed, rank, True)
    plain = _train_with_backward(mixed, rank, False)
    everyone = allgather(overlapped)
    assert all(torch.equal(a, b) for a, b in zip(overlapped, plain, strict=True)), rank
    assert all(torch.equal(a, b) for a, b in zip(everyone[0], overlapped, strict=True)), rank
    assert mixed.calls_by_backend["torch"] > 0 and mixed.calls_by_backend["mpi"] > 0


def _uneven(backend, rank: int, joined: bool) -> list[torch.Tensor]:
    """:func:`train`'s parameters with rank 1 out of data after 5 of 10 steps: inside torch's
    ``Join`` (``joined``), or stepping on zero gradients."""
    from torch.distributed.algorithms.join import Join

    params = [torch.nn.Parameter(torch.zeros(s)) for s in [(64, 33), (4096,)]]
    opt = OnebitAdam(params, lr=1e-2, freeze_step=4, backend=backend)
    mine = 5 if joined and rank == 1 else 10
    with Join([opt]) if joined else contextlib.nullcontext():
        for step in range(mine):
            g = torch.Generator().manual_seed(1000 * step + rank)
            for p in params:
                p.grad = torch.randint(-64, 65, p.shape, generator=g).float() / 64
                if rank == 1 and step >= 5:
                    p.grad.zero_()
            opt.step()
    return [p.detach().clone() for p in params]


def test_join_through_mixed_shadows_the_mpi_collectives_and_mpi_alone_is_refused(
    torch_backend, mpi_backend, world, allgather
) -> None:
    """torch's Join counts the joined ranks over the MixedBackend's torch group, while the
    optimizer's collectives go through both libraries; an MpiBackend has no torch group."""
    from torch.distributed.algorithms.join import Join

    rank = world[0]
    mixed = MixedBackend({"torch": torch_backend, "mpi": mpi_backend}, SWITCHING)
    joined = _uneven(mixed, rank, True)
    zeros = _uneven(mixed, rank, False)
    try:
        Join([OnebitAdam([torch.nn.Parameter(torch.ones(2))], freeze_step=3, backend=mpi_backend)])
        refused = ""
    except TypeError as e:
        refused = str(e)
    everyone = allgather(joined)
    assert all(torch.equal(a, b) for a, b in zip(joined, zeros, strict=True))
    for theirs in everyone:
        assert all(torch.equal(a, b) for a, b in zip(joined, theirs, strict=True))
    assert "torch's Join counts the joined ranks" in refused and "MpiBackend" in refused
