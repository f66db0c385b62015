"""Each experiment of issue 13 (experiments/algorithms/*) runs as one command with ``--out`` and
writes its results: tiny sizes, a few steps, 2 ranks, so CI keeps the commands working. The
numbers are not checked (too few steps to mean anything); the tables' rows and finite losses
are.

Each command's ``main(argv)`` runs in this process, which forks its ranks as ``python -m`` would:
a fresh interpreter per command would pay ``import torch, commopt`` (≈ 5 s) nine times over.
"""

from __future__ import annotations

import importlib
import math
import pathlib
import re

import matplotlib
import pytest

matplotlib.use("Agg")  # the figures are written to files, never shown


def _run(module: str, out: pathlib.Path, *args: str) -> None:
    assert importlib.import_module(module).main(["--out", str(out), *args]) == 0


def _losses(table: str, label: str) -> list[float]:
    row = next(line for line in table.splitlines() if line.startswith(f"| {label} |"))
    return [float(x) for x in re.findall(r"\d+\.\d{4}", row)]


def test_freeze_digits_two_seeds(tmp_path):
    _run(
        "experiments.algorithms.freeze",
        tmp_path,
        *("--task", "digits", "--steps", "8", "--sweep", "3,5", "--seeds", "0,1", "--ranks", "2"),
    )
    for name in ("freeze_digits_seed0.md", "freeze_digits_seed1.png", "freeze_digits_seeds.md"):
        assert (tmp_path / name).stat().st_size > 0
    seeds = (tmp_path / "freeze_digits_seeds.md").read_text()
    assert "gap to the seed's best fixed step" in seeds
    for label in ("OnebitAdam F=3", "OnebitAdam F=5", "OnebitAdam auto"):
        assert all(map(math.isfinite, _losses(seeds, label)))


def test_error_feedback(tmp_path):
    args = ("--steps", "6", "--warmup", "3", "--etas", "0.2", "--ranks", "2")
    _run("experiments.algorithms.error_feedback", tmp_path, *args, "--only", _ef_labels())
    table = (tmp_path / "error_feedback_digits.md").read_text()
    assert "OnebitAdam econtrol η=0.2" in table and "OnebitAdam classic" in table
    assert (tmp_path / "error_feedback_digits.png").stat().st_size > 0


def _ef_labels() -> str:
    return "OnebitAdam classic,OnebitAdam econtrol η=0.2"


def test_trust_ratio_linear(tmp_path):
    _run("experiments.algorithms.trust_ratio", tmp_path, "--problems", "linear")
    table = (tmp_path / "trust_ratio_linear.md").read_text()
    assert all(map(math.isfinite, _losses(table, "linear")))


def test_auto_others(tmp_path):
    _run("experiments.algorithms.auto_others", tmp_path, "--steps", "4", "--ranks", "2")
    table = (tmp_path / "auto_lm_others.md").read_text()
    assert "OnebitLamb auto frozen" in table and "ZeroOneAdam auto, no bias correction" in table


@pytest.mark.parametrize("variant", ["ZeroOneAdam β2=0.999 guard=tiny", "OnebitLamb guard=off"])
def test_guard(tmp_path, variant):
    small = ("--small", "--steps", "8", "--warmup", "3", "--ranks", "2", "--seeds", "0,1")
    _run("experiments.algorithms.guard", tmp_path, *small, "--variants", variant)
    table = (tmp_path / "guard.md").read_text()
    assert f"| {variant} |" in table and "val loss seed 1" in table


def test_zero_one_bias(tmp_path):
    variants = "Adam,ZeroOneAdam β2=0.999 T_v=75 bias_correction=on"
    small = ("--small", "--steps", "8", "--warmup", "3", "--ranks", "2", "--seeds", "0,1")
    _run("experiments.algorithms.zero_one_bias", tmp_path, *small, "--variants", variants)
    table = (tmp_path / "zero_one_bias.md").read_text()
    for label in variants.split(","):
        losses = _losses(table, label)
        assert len(losses) >= 3 and all(map(math.isfinite, losses)), table


def test_error_feedback_lm(tmp_path):
    small = ("--small", "--steps", "8", "--warmup", "3", "--ranks", "2", "--seeds", "0")
    _run("experiments.algorithms.error_feedback_lm", tmp_path, *small)
    table = (tmp_path / "error_feedback_lm.md").read_text()
    assert "| OnebitAdam econtrol η=0.2 |" in table and "| OnebitAdam classic |" in table


T600 = "freeze_traces_digits600.json"


def test_freeze_rules_replay_and_run(tmp_path):
    _run("experiments.algorithms.freeze_rules", tmp_path)
    replay = (tmp_path / "freeze_rules_replay.md").read_text()
    assert "| signal anchor 6·t_n |" in replay and "| log-range τ=0.05 (today) |" in replay
    # The committed table (docs/algorithms/auto_freeze.md quotes it) is what the replay of the
    # committed traces gives.
    results = pathlib.Path(__file__).parents[2] / "experiments/algorithms/results"
    assert replay == (results / "freeze_rules_replay.md").read_text()
    _run("experiments.algorithms.freeze_rules", tmp_path, "--traces", str(results / T600))
    replay600 = (tmp_path / "freeze_traces_digits600_replay.md").read_text()
    assert replay600 == (results / "freeze_traces_digits600_replay.md").read_text()
    args = ("--run", "snr-anchor", "--task", "digits", "--seeds", "0", "--steps", "8")
    _run("experiments.algorithms.freeze_rules", tmp_path, *args, "--sweep", "3")
    table = (tmp_path / "freeze_rule_snr-anchor_digits_8steps.md").read_text()
    assert all(map(math.isfinite, _losses(table, "rule snr-anchor"))), table
