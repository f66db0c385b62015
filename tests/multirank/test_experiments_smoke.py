"""Smoke runs of the experiment scripts (a few steps, 2 forked gloo ranks) so they never rot.

Besides "it runs and writes its outputs", the byte counters are checked against the ring model
computed here from the parameter count: Adam sends 2(n−1)/n·4·N bytes per step, DDP's fp16
hook half of that, and the 1-bit optimizers less than either once compressing.
"""

from __future__ import annotations

import csv
import json
import pathlib

import pytest

pytest.importorskip("matplotlib", reason="the experiments extra (matplotlib) is not installed")
pytest.importorskip("sklearn", reason="the experiments extra (scikit-learn) is not installed")
pytest.importorskip("tqdm", reason="the experiments extra (tqdm) is not installed")

from experiments.convergence import run as convergence
from experiments.convergence import seeds as convergence_seeds
from experiments.diloco import convergence as diloco_convergence
from experiments.harness.tasks import load_task
from experiments.optim import bench_step
from experiments.tcp import bench as tcp
from tests.optim_registry import BY_NAME

N = 2
STEPS = 6
WARMUP = 2


def _read(path: pathlib.Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _ring_fp32(numel: int) -> float:
    return 2 * (N - 1) / N * 4 * numel


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "task,task_args",
    [
        ("digits", ["width=4"]),
        (
            "lm",
            [
                "d=16",
                "layers=1",
                "context=16",
                "batch_per_rank=4",
                "eval_windows=8",
                "max_corpus_bytes=1000000",
            ],
        ),
    ],
)
def test_convergence_smoke(tmp_path: pathlib.Path, task: str, task_args: list[str]) -> None:
    argv = [
        "--task",
        task,
        "--world-size",
        str(N),
        "--steps",
        str(STEPS),
        "--warmup",
        str(WARMUP),
        "--eval-every",
        "3",
        "--out",
        str(tmp_path),
        "--no-progress",
        "--timeout",
        "200",
    ]
    for a in task_args:
        argv += ["--task-arg", a]
    assert convergence.main(argv) == 0

    folder = tmp_path / task
    assert (folder / "curves.png").stat().st_size > 10_000
    summary = (folder / "summary.md").read_text()
    runs = {}
    for label in convergence.CONVERGENCE_VARIANTS:
        assert f"| {label} |" in summary
        rows = _read(folder / f"{label}.csv")
        assert [int(r["step"]) for r in rows] == list(range(STEPS + 1))
        assert [r["val_loss"] != "" for r in rows] == [s % 3 == 0 for s in range(STEPS + 1)]
        sent = [int(r["bytes_sent"]) for r in rows]
        assert sent[0] == 0 and sent == sorted(sent) and sent[-1] > 0
        runs[label] = sent

    fields = {}
    for a in task_args:
        k, v = a.split("=")
        fields[k] = type(convergence._task_default(task, k))(v)
    numel = sum(p.numel() for p in load_task(task, **fields).build_model().parameters())
    per_step = [b - a for a, b in zip(runs["Adam"], runs["Adam"][1:], strict=False)]
    assert per_step == [int(_ring_fp32(numel))] * STEPS
    fp16 = [b - a for a, b in zip(runs["DDP-fp16"], runs["DDP-fp16"][1:], strict=False)]
    assert fp16 == [int(_ring_fp32(numel) / 2)] * STEPS
    # After the freeze step every 1-bit variant sends far less per step than the fp16 hook.
    for label in BY_NAME:
        late = runs[label][-1] - runs[label][WARMUP + 1]
        assert late < (STEPS - WARMUP - 1) * fp16[0] / 4, label


def test_seed_table_arithmetic() -> None:
    rows = convergence_seeds.seed_table({"Adam": [1.0, 2.0], "X": [2.0, 4.0]}, [0, 1])
    assert rows[2] == "| Adam | 1.0000 | 2.0000 | 1.5000 | – |"
    # paired differences 1 and 2: mean 1.5, standard error sd/√2 = 0.7071/1.4142 = 0.5
    assert rows[3] == "| X | 2.0000 | 4.0000 | 3.0000 | +1.5000 ± 0.5000 |"


@pytest.mark.timeout(240)
def test_convergence_seeds_smoke(tmp_path: pathlib.Path) -> None:
    argv = ["--task", "digits", "--seeds", "0,1", "--steps", str(STEPS), "--world-size", str(N)]
    argv += ["--optimizers", "Adam,ZeroOneAdam", "--out", str(tmp_path), "--timeout", "200"]
    assert convergence_seeds.main(argv) == 0
    table = (tmp_path / "digits" / "seeds.md").read_text()
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in table.splitlines()
        if line.startswith("| ") and not line.startswith("| variant")
    }
    assert list(rows) == ["Adam", "ZeroOneAdam", "ZeroOneAdam (papers' rules)"]
    assert rows["Adam"][0] != rows["Adam"][1]  # the seed draws another run
    # Phase A with the bias correction is Adam's step; without it (the papers' rule) it is not.
    assert rows["ZeroOneAdam"][:2] == rows["Adam"][:2]
    assert rows["ZeroOneAdam (papers' rules)"][:2] != rows["Adam"][:2]


@pytest.mark.timeout(240)
def test_diloco_convergence_smoke(tmp_path: pathlib.Path) -> None:
    argv = ["--task", "digits", "--seeds", "0", "--steps", str(STEPS), "--world-size", str(N)]
    argv += ["--optimizers", "Adam,DiLoCo-none-H3,DiLoCo-onebit-H3,DiLoCo-onebit-H2-P2-d0-tensor"]
    assert diloco_convergence.main([*argv, "--out", str(tmp_path), "--timeout", "200"]) == 0
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in (tmp_path / "digits-4-variants.md").read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| variant")
    }
    assert list(rows) == [
        "Adam",
        "DiLoCo-none-H3",
        "DiLoCo-onebit-H3",
        "DiLoCo-onebit-H2-P2-d0-tensor",
    ]
    assert all(r[-1] == "yes" for r in rows.values())  # replicas identical at the end
    # bits per parameter per step: Adam 32·2(n−1)/n = 32; fp32 DiLoCo H = 3 a third of it
    assert float(rows["Adam"][3]) == pytest.approx(32.0, rel=1e-3)
    assert float(rows["DiLoCo-none-H3"][3]) == pytest.approx(32.0 / 3, rel=1e-3)
    assert float(rows["DiLoCo-onebit-H3"][3]) < 1.0


@pytest.mark.timeout(240)
def test_tcp_bench_smoke(tmp_path: pathlib.Path) -> None:
    out, js = tmp_path / "t.md", tmp_path / "t.json"
    argv = [
        "--world-size",
        str(N),
        "--width",
        "32",
        "--hidden",
        "64",
        "--warmup",
        "2",
        "--settle",
        "3",
        "--measure",
        "4",
        "--local-step-clipper",
        "2",
        "--bucket-numel",
        "3000",  # several buckets, so the overlap variants start exchanges during backward
        "--diloco-measure",
        "50",  # Local and DiLoCo: one sync of every fragment in the window
        "--out",
        str(out),
        "--json",
        str(js),
        "--quiet",
        "--timeout",
        "200",
    ]
    assert tcp.main(argv) == 0
    table = out.read_text()
    for label in tcp.TCP_VARIANTS:
        assert f"| {label} |" in table
    assert "| DDP-fp32 | full |" in table and "1.00x" in table
    res = json.loads(js.read_text())
    numel = sum(p.numel() for p in tcp.WideMLP(32, 64, 1).parameters())
    assert res["numel"] == numel
    v = res["variants"]
    assert v["DDP-fp16"]["bytes_per_step"] == pytest.approx(_ring_fp32(numel) / 2)
    assert v["OnebitAdam"]["stage"] == "compressed" and v["ZeroOneAdam"]["stage"] == "phaseB"
    # Phase B with a local interval of 2: a sync every other step, nothing in between.
    assert v["ZeroOneAdam"]["bytes_per_step"] < v["OnebitAdam"]["bytes_per_step"]
    assert all(e["mean_ms"] > 0 for e in v.values())
    # overlap on gives the same bits as off, for every optimizer and phase timed
    overlap = [label for label in v if label.endswith("-overlap")]
    assert len(overlap) == 5
    assert all(v[label]["same_as_off"] is True for label in overlap)
    # replicas agree after the timed steps, except 0/1 Adam between its syncs (interval 2) and
    # Local, which never communicates (DiLoCo's finish() syncs every fragment before the check)
    for label, e in v.items():
        assert e["skipped_steps"] == 0, label
        if label == "Local":
            assert e["replicas_identical"] is False and e["bytes_per_step"] == 0
        elif not label.startswith("ZeroOneAdam") or "1bitA" in label or "syncB" in label:
            assert e["replicas_identical"] is True, label
    # DiLoCo H = 50 over 50 timed steps: one sync of each fragment, counted without finish()'s
    n_sync = 2 * (N - 1) / N * (numel // 8)  # the signs of one 1-bit sync of the whole model
    for label in ("DiLoCo-onebit-H50", "DiLoCo-onebit-H50-P4-d4"):
        assert v[label]["timed_steps"] == 50
        assert n_sync / 50 <= v[label]["bytes_per_step"] <= 1.2 * n_sync / 50 + 200, label
    # phases: 1bitA stays in phase A and sends 1-bit rounds; syncB syncs at every timed step
    assert v["ZeroOneAdam-1bitA"]["stage"] == "phaseA"
    assert v["ZeroOneAdam-1bitA"]["timed_1bit_rounds"] > 0
    assert v["ZeroOneAdam-syncB"]["stage"] == "phaseB"
    # (one 1-bit round per bucket and step, as 1-bit Adam's compression stage)
    assert v["ZeroOneAdam-syncB"]["timed_1bit_rounds"] == v["OnebitAdam"]["timed_1bit_rounds"] > 0
    assert v["ZeroOneAdam-syncB"]["timed_fp32_rounds"] == 0
    assert v["OnebitLamb-overlap"]["timed_1bit_rounds"] == v["OnebitLamb"]["timed_1bit_rounds"]


@pytest.mark.timeout(240)
def test_optimizer_step_bench_smoke(tmp_path: pathlib.Path, capsys) -> None:
    js = tmp_path / "step.json"
    argv = ["--world-size", str(N), "--width", "64", "--io", "16", "--steps", "2"]
    assert bench_step.main([*argv, "--rounds", "1", "--json", str(js)]) == 0
    table = capsys.readouterr().out
    for label in bench_step.VARIANTS:
        assert f"| {label} |" in table
    res = json.loads(js.read_text())
    assert res["numel"] == 64 * 16 + 64 + 64 * 64 + 64 + 16 * 64 + 16
    for r in res["results"].values():
        assert r["wall_ms"] > 0 and len(r["cpu_ms_per_rank"]) == N
