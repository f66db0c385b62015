"""Selection tables and MixedBackend routing in a world of one process (no communication)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from commopt.cli import _measure, tune
from commopt.comm import CommStats, MixedBackend, SingleProcessBackend
from commopt.comm.table import SelectionTable, canonical_json, load_table


def rule(op, lo, hi, backend, dtype="*"):
    return {"op": op, "dtype": dtype, "min_bytes": lo, "max_bytes": hi, "backend": backend}


def table(rules, default="a"):
    return {"format": "commopt-selection-table", "version": 1, "default": default, "rules": rules}


GOOD = table(
    [
        rule("all_reduce", 0, 1024, "a"),
        rule("all_reduce", 1024, 65536, "b"),
        rule("all_reduce", 65536, None, "a"),
        rule("all_reduce", 0, 4096, "b", dtype="float16"),
        rule("all_reduce", 4096, None, "a", dtype="float16"),
        rule("all_to_all", 0, None, "b"),
    ]
)


class Recorder:
    """A world-of-one backend that logs which calls reached it."""

    def __init__(self, name: str) -> None:
        self.name, self.rank, self.world_size = name, 0, 1
        self.stats = CommStats()
        self.log: list[str] = []
        self._inner = SingleProcessBackend()

    def _rec(self, op: str, nbytes: int) -> None:
        self.log.append(op)
        self.stats.record(op, nbytes, 1)

    def all_reduce(self, t, op="sum"):
        self._rec("all_reduce", t.numel() * t.element_size())
        return self._inner.all_reduce(t, op)

    def all_gather(self, out, t):
        self._rec("all_gather", t.numel() * t.element_size())
        return self._inner.all_gather(out, t)

    def all_to_all(self, out, t):
        self._rec("all_to_all", t.numel() * t.element_size())
        return self._inner.all_to_all(out, t)

    def broadcast(self, t, src=0):
        self._rec("broadcast", t.numel() * t.element_size())
        return self._inner.broadcast(t, src)

    def barrier(self):
        self._rec("barrier", 0)


def reference_select(rules, default, op, nbytes, dtype):
    """Linear scan written independently of SelectionTable's bisect."""
    for want in (dtype, "*"):
        hits = [r for r in rules if r["op"] == op and r["dtype"] == want]
        if hits:
            for r in hits:
                if r["min_bytes"] <= nbytes and (r["max_bytes"] is None or nbytes < r["max_bytes"]):
                    return r["backend"]
            raise AssertionError("reference: no range matched")
    return default


@pytest.mark.parametrize("op", ["all_reduce", "all_to_all", "all_gather", "barrier"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "int64"])
def test_select_matches_linear_scan_at_every_border(op, dtype):
    sel = SelectionTable(GOOD, available={"a", "b"})
    sizes = {0, 1, 2**40}
    for r in GOOD["rules"]:
        for b in (r["min_bytes"], r["max_bytes"]):
            if b is not None:
                sizes |= {max(b - 1, 0), b, b + 1}
    for s in sorted(sizes):
        want = reference_select(GOOD["rules"], "a", op, s, dtype)
        assert sel.select(op, s, getattr(torch, dtype)) == want, (op, s, dtype)


@pytest.mark.parametrize(
    "rules, match",
    [
        (
            [rule("all_reduce", 0, 100, "a"), rule("all_reduce", 200, None, "a")],
            r"gap.*\[100, 200\)",
        ),
        ([rule("all_reduce", 10, None, "a")], r"gap.*\[0, 10\)"),
        ([rule("all_reduce", 0, 100, "a")], r"gap.*\[100, ∞\).*max_bytes null"),
        ([rule("all_reduce", 0, 100, "a"), rule("all_reduce", 50, None, "b")], r"overlap.*at 50"),
        ([rule("all_reduce", 0, None, "a"), rule("all_reduce", 50, None, "b")], r"overlap"),
        ([rule("all_reduce", 0, None, "nccl")], r"backend 'nccl'.*not available.*\['a', 'b'\]"),
        ([rule("allreduce", 0, None, "a")], r"unknown op 'allreduce'"),
        ([rule("all_reduce", 0, None, "a", dtype="float33")], r"dtype.*'float33'"),
        ([rule("all_reduce", 100, 100, "a")], r"empty range"),
        ([rule("all_reduce", -1, None, "a")], r"min_bytes must be a non-negative integer"),
        ([rule("all_reduce", 0, 1.5, "a")], r"max_bytes must be"),
        ([{"op": "all_reduce", "backend": "a"}], r"rules\[0\] lacks \['dtype', 'max_bytes'"),
        (["all_reduce"], r"rules\[0\] must be an object"),
    ],
)
def test_bad_rules_are_rejected_with_a_clear_message(rules, match):
    with pytest.raises(ValueError, match=match):
        SelectionTable(table(rules), available={"a", "b"})
    # ... and MixedBackend refuses it at construction, before any call.
    with pytest.raises(ValueError, match=match):
        MixedBackend({"a": Recorder("a"), "b": Recorder("b")}, table(rules))


@pytest.mark.parametrize(
    "bad, match",
    [
        ({**GOOD, "format": "something"}, r"format must be 'commopt-selection-table'"),
        ({**GOOD, "version": 2}, r"version 2 is not supported"),
        ({**GOOD, "default": "c"}, r"'default' names backend 'c'.*not available"),
        ({**GOOD, "rules": {}}, r"'rules' must be a list"),
    ],
)
def test_malformed_tables(bad, match):
    with pytest.raises(ValueError, match=match):
        MixedBackend({"a": Recorder("a"), "b": Recorder("b")}, bad)


def test_table_from_json_path_and_bad_files(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(GOOD))
    mixed = MixedBackend({"a": Recorder("a"), "b": Recorder("b")}, path)
    assert canonical_json(mixed.table) == canonical_json(GOOD)
    assert mixed.select("all_to_all", 5) == "b"
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"bad.json' is not valid JSON"):
        MixedBackend({"a": Recorder("a")}, tmp_path / "bad.json")
    with pytest.raises(ValueError, match=r"does not exist.*commopt tune"):
        MixedBackend({"a": Recorder("a")}, tmp_path / "missing.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"must hold a JSON object, got list"):
        load_table(tmp_path / "list.json")
    with pytest.raises(TypeError, match=r"dict or a path"):
        load_table(42)


def test_a_directory_or_a_deeply_nested_table_is_a_value_error(tmp_path):
    # Issue #41.4: IsADirectoryError and RecursionError escaped on the rank that read them
    # (the agreement only turned ValueError/TypeError into an answer for every rank).
    with pytest.raises(ValueError, match=r"cannot be read: \[Errno 21\] Is a directory"):
        load_table(tmp_path)
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"deep.json' is nested too deeply"):
        load_table(tmp_path / "deep.json")
    deep: dict = {}
    for _ in range(100_000):
        deep = {"a": deep}
    with pytest.raises(ValueError, match=r"nested too deeply"):
        load_table(deep)


def test_children_must_be_backends_with_distinct_names():
    with pytest.raises(ValueError, match=r"two backends are named 'single'"):
        MixedBackend([SingleProcessBackend(), SingleProcessBackend()], GOOD)
    with pytest.raises(TypeError, match=r"does not implement the Backend protocol"):
        MixedBackend({"a": object()}, GOOD)
    with pytest.raises(ValueError, match=r"at least one child"):
        MixedBackend({}, GOOD)
    other = Recorder("b")
    other.world_size = 2
    with pytest.raises(ValueError, match=r"disagree.*'b' says rank 0 of 2"):
        MixedBackend({"a": Recorder("a"), "b": other}, GOOD)


def test_routing_counts_and_children_stats():
    a, b = Recorder("a"), Recorder("b")
    mixed = MixedBackend({"a": a, "b": b}, GOOD)
    x32 = torch.arange(8, dtype=torch.float32)  # 32 bytes → a
    big = torch.zeros(2048, dtype=torch.float32)  # 8 KiB → b
    x16 = torch.zeros(16, dtype=torch.float16)  # 32 bytes fp16 → b
    assert torch.equal(mixed.all_reduce(x32.clone()), x32)
    mixed.all_reduce(big)
    mixed.all_reduce(x16)
    out = torch.empty(8)
    mixed.all_to_all(out, x32)
    assert torch.equal(out, x32)
    mixed.all_gather(out, x32)
    mixed.broadcast(x32)
    mixed.barrier()
    assert a.log == ["all_reduce", "all_gather", "broadcast", "barrier"]
    assert b.log == ["all_reduce", "all_reduce", "all_to_all"]
    assert mixed.calls_by_backend == {"a": 4, "b": 3}
    assert mixed.switches == 2  # a → b (call 2), b → a (call 5)
    assert mixed.stats.calls == 7 and a.stats.calls + b.stats.calls == 7
    assert mixed.stats.calls_by_op == {
        "all_reduce": 3,
        "all_to_all": 1,
        "all_gather": 1,
        "broadcast": 1,
        "barrier": 1,
    }


def test_optimizer_accepts_a_mixed_backend_in_a_world_of_one():
    import commopt

    w1 = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    w2 = torch.nn.Parameter(w1.detach().clone())
    mixed = MixedBackend({"a": Recorder("a"), "b": Recorder("b")}, GOOD)
    opts = [
        commopt.OnebitAdam([w1], lr=0.1, freeze_step=2, backend=mixed),
        commopt.OnebitAdam([w2], lr=0.1, freeze_step=2, backend=SingleProcessBackend()),
    ]
    for _ in range(4):
        for w, opt in zip((w1, w2), opts, strict=True):
            opt.zero_grad()
            (w**2).sum().backward()
            opt.step()
    assert torch.equal(w1, w2)


def test_build_rules_tiles_and_puts_borders_at_geometric_means():
    sizes = [1024, 4096, 16384, 65536]
    rules = tune.build_rules(sizes, ["a", "a", "b", "a"], "all_gather", "*")
    assert [(r["min_bytes"], r["max_bytes"], r["backend"]) for r in rules] == [
        (0, math.isqrt(4096 * 16384), "a"),
        (math.isqrt(4096 * 16384), math.isqrt(16384 * 65536), "b"),
        (math.isqrt(16384 * 65536), None, "a"),
    ]
    SelectionTable(table(rules), available={"a", "b"})  # valid as written


def test_winners_keep_previous_within_tie_margin():
    times = {"a": [1.0, 1.03, 2.0, 1.0], "b": [2.0, 1.0, 1.0, 0.99]}
    assert tune._winners(times, 0.05) == ["a", "a", "b", "b"]
    assert tune._winners(times, 0.0) == ["a", "b", "b", "b"]


@pytest.mark.parametrize(
    "text, value", [("1KiB", 1024), ("64M", 64 << 20), ("4096", 4096), ("2g", 2 << 30)]
)
def test_parse_bytes(text, value):
    assert _measure.parse_bytes(text) == value


def test_size_range_ends_at_max_and_rejects_nonsense():
    assert _measure.size_range(1024, 65536, 4) == [1024, 4096, 16384, 65536]
    assert _measure.size_range(1000, 5000, 2) == [1000, 2000, 4000, 5000]
    with pytest.raises(ValueError, match="--min-bytes <= --max-bytes"):
        _measure.size_range(10, 5)


def test_cli_without_ranks_says_how_to_launch(capsys, monkeypatch):
    from commopt.cli.main import main

    for var in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert main(["tune", "--max-bytes", "1K"]) == 2
    assert "launch it with mpirun/mpiexec or torchrun" in capsys.readouterr().err
