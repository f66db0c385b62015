"""``commopt tune`` and ``commopt bench`` on two forked gloo ranks, and MixedBackend over two
gloo process groups (two real, independent backends without MPI)."""

from __future__ import annotations

import csv
import json
import logging
import os

import pytest
import torch
import torch.distributed as dist

from commopt.comm import MixedBackend, TorchBackend
from commopt.comm.table import SelectionTable, canonical_json
from tests.multirank.harness import run_ranks

TUNE_ARGS = (
    "--min-bytes 1K --max-bytes 8K --factor 2 --reps 2 --warmup 1 --no-progress "
    "--ops all_reduce,all_gather,broadcast,compressed_allreduce --reduce-dtypes float32,bfloat16"
)


def _tune_then_load(backend, path):
    from commopt.cli.main import main

    status = main(["tune", "-o", path, *TUNE_ARGS.split()])
    mixed = MixedBackend({"torch": backend}, path)
    t = torch.full((1000,), float(backend.rank + 1))
    mixed.all_reduce(t)
    return status, canonical_json(mixed.table), t


def test_tune_on_two_ranks_writes_a_table_mixed_backend_loads(tmp_path):
    path = str(tmp_path / "table.json")
    results = run_ranks(_tune_then_load, 2, path, timeout=240)

    assert [r[0] for r in results] == [0, 0]
    assert results[0][1] == results[1][1]
    for _, _, t in results:
        assert torch.equal(t, torch.full((1000,), 3.0))
    with open(path, encoding="utf-8") as f:
        table = json.load(f)
    assert canonical_json(table) == results[0][1]
    SelectionTable(table, available={"torch"})
    assert table["world_size"] == 2 and table["backends"] == ["torch"]
    assert table["default"] == "torch"
    created = table["created"]
    assert {"date", "host", "versions", "command"} <= set(created)
    assert created["versions"]["torch"] == torch.__version__
    meas = table["measurements"]
    assert meas["repetitions"] == 2 and meas["warmup"] == 1
    want_keys = {
        "all_reduce/float32",
        "all_reduce/bfloat16",
        "all_gather/float32",
        "broadcast/float32",
        "compressed_allreduce/float32",
    }
    assert set(meas["times"]) == want_keys
    for key, per in meas["times"].items():
        assert meas["sizes"][key] == [1024, 2048, 4096, 8192]
        assert list(per) == ["torch"]
        assert len(per["torch"]) == 4 and all(x > 0 for x in per["torch"])
    ops = {(r["op"], r["dtype"]) for r in table["rules"]}
    assert ops == {
        ("all_reduce", "float32"),
        ("all_reduce", "*"),
        ("all_reduce", "bfloat16"),
        ("all_gather", "*"),
        ("broadcast", "*"),
    }


def _bench(backend, csv_path, png_path):
    from commopt.cli.main import main

    args = "--min-bytes 1K --max-bytes 16K --factor 4 --reps 2 --warmup 1 --no-progress"
    args += " --ops all_reduce,compressed_allreduce,all_to_all"
    return main(["bench", *args.split(), "--csv", csv_path, "--plot", png_path])


def test_bench_on_two_ranks_prints_csv_and_plot(tmp_path, capfd):
    pytest.importorskip("matplotlib", reason="--plot needs the experiments extra (matplotlib)")
    csv_path, png_path = str(tmp_path / "b.csv"), str(tmp_path / "b.png")
    assert run_ranks(_bench, 2, csv_path, png_path, timeout=240) == [0, 0]
    out = capfd.readouterr().out
    for heading in (
        "all_reduce (float32)",
        "all_reduce (float16)",
        "all_reduce (bfloat16)",
        "compressed_allreduce (float32)",
        "all_to_all (float32)",
        "speed-up of compressed_allreduce over dense float32 all_reduce",
    ):
        assert heading in out, heading
    # both ranks on this machine: the speed-ups are not network figures, and bench says so
    assert "note: every rank runs on this one host" in " ".join(out.split())
    with open(csv_path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 5 * 3  # 5 (op, dtype) × 3 sizes × 1 backend
    for r in rows:
        secs, size = float(r["seconds"]), int(r["bytes"])
        assert secs > 0 and r["backend"] == "torch"
        # algbw is size / time, reported in GB/s
        assert abs(float(r["algbw_GBps"]) - size / secs / 1e9) <= 1e-9 * size / secs
        if r["op"] == "all_reduce":  # busbw = 2(n-1)/n · size / time, n = 2
            assert abs(float(r["busbw_GBps"]) - float(r["algbw_GBps"])) < 1e-9
    with open(png_path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png_path) > 10_000


def _two_groups(backend, caplog_tables):
    """A second gloo group over the same ranks: two independent backends to mix."""
    other = TorchBackend(dist.new_group(backend="gloo"))
    tables = caplog_tables
    records = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("commopt.comm.mixed").addHandler(handler)
    mixed = MixedBackend({"a": backend, "b": other}, tables[backend.rank])
    outs = []
    for i in range(60):  # sizes alternate around the border: a switch on most calls
        numel = 64 if i % 2 else 4096
        t = torch.arange(numel, dtype=torch.float32) + backend.rank * i
        outs.append(mixed.all_reduce(t).clone())
    return mixed.corrected, canonical_json(mixed.table), mixed.switches, outs, len(records)


def _table(border):
    rules = [
        {"op": "all_reduce", "dtype": "*", "min_bytes": 0, "max_bytes": border, "backend": "a"},
        {"op": "all_reduce", "dtype": "*", "min_bytes": border, "max_bytes": None, "backend": "b"},
    ]
    return {"format": "commopt-selection-table", "version": 1, "default": "a", "rules": rules}


def test_mixed_over_two_gloo_groups_and_table_correction():
    tables = [_table(1000), _table(10**9)]  # rank 1 holds a stale table
    results = run_ranks(_two_groups, 2, tables, timeout=120)
    (c0, t0, s0, o0, w0), (c1, t1, s1, o1, w1) = results
    assert (c0, c1) == (False, True)
    assert t0 == t1 == canonical_json(tables[0])
    assert (w0, w1) == (0, 1)  # the corrected rank logged a warning
    assert s0 == s1 == 59
    for i, (a, b) in enumerate(zip(o0, o1, strict=True)):
        numel = 64 if i % 2 else 4096
        want = 2 * torch.arange(numel, dtype=torch.float32) + i
        assert torch.equal(a, want) and torch.equal(b, want), i


def _workload(backend):
    from commopt.cli.main import main

    args = "--workload onebit_adam --numel 20K --steps 5 --freeze-step 2 --no-progress"
    return main(["bench", *args.split()])


def test_bench_workload_runs_warmup_and_compression(capfd):
    assert run_ranks(_workload, 2, timeout=240) == [0, 0]
    out = capfd.readouterr().out
    assert "OnebitAdam workload: 20480 parameters in 19 tensors, 5 steps (2 warmup), 2 ranks" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("torch:"))
    fields = dict(kv.split("=") for kv in line.split(":", 1)[1].strip().split(", "))
    assert float(fields["warmup_step_ms"]) > 0 and float(fields["compressed_step_ms"]) > 0
    assert float(fields["max_abs_diff_vs_torch"]) == 0.0
    # 5 steps; each has a flag all-reduce, warmup steps a dense all-reduce per bucket, compressed
    # steps four collectives per bucket: well over 5 calls, and a barrier per step is not counted.
    assert int(fields["calls"]) >= 5 * 2
