# ruff: noqa: E402  (torch is imported after its CPU kernels are capped, below)
r"""Convergence suite: every optimizer variant on the same data, same seeds, same order.

One command per task (4 forked gloo ranks on this machine unless launched by torchrun/mpirun)::

    python -m experiments.convergence.run --task lm
    python -m experiments.convergence.run --task digits
    python -m experiments.convergence.run --task all          # both, one after the other

Outputs, under ``--out`` (default ``experiments/convergence/results``)/<task>/:

- ``<variant>.csv``: one row per step: stage, train loss (mean over ranks), validation loss
  and metric (on evaluation steps), this rank's cumulative modelled bytes sent, collective
  calls, steps that exchanged data, cumulative training wall time (evaluation excluded);
- ``curves.png``: validation loss against step and against bytes sent per rank;
- ``summary.md``: final metric, total bytes and ratio to Adam, collectives, time per step.

Variants and the byte model: :mod:`experiments.harness.training`. The models, data and split:
:mod:`experiments.harness.tasks`.
"""

from __future__ import annotations

from experiments.cpu_isa import cap_at_avx2

cap_at_avx2()  # before torch loads: the losses reported move with an ulp (see there)

import argparse
import csv
import dataclasses
import math
import pathlib
import sys
import time
from typing import Any

import torch.distributed as dist

from experiments.harness import (
    Hyper,
    Setup,
    describe_machine,
    is_variant,
    launch,
    make_setup,
    replicas_identical,
    sum_over_ranks,
    train_on_task,
)
from experiments.harness.tasks import TASKS, load_task

__all__ = [
    "CONVERGENCE_VARIANTS",
    "DEFAULTS",
    "main",
    "parse_variants",
    "task_hyper",
    "train_variants",
]

CONVERGENCE_VARIANTS = (
    "Adam",
    "OnebitAdam",
    "ZeroOneAdam",
    "LAMB",
    "OnebitLamb",
    "DDP-fp16",
    "DDP-PowerSGD",
)

# Per task: steps, warmup (freeze_step etc.), learning rates, ZeroOneAdam's local-step growth.
DEFAULTS: dict[str, dict[str, Any]] = {
    "lm": dict(steps=300, warmup=60, lr=3e-3, lamb_lr=1e-2, eval_every=20),
    "digits": dict(steps=300, warmup=60, lr=2e-3, lamb_lr=1e-2, eval_every=15),
}

_FIELDS = [
    "step",
    "stage",
    "train_loss",
    "val_loss",
    "val_metric",
    "bytes_sent",
    "collectives",
    "comm_steps",
    "train_time_s",
]


def parse_variants(parser: argparse.ArgumentParser, value: str) -> list[str]:
    """The comma-separated ``--optimizers`` value as a list; an unknown name is a usage error."""
    variants = [v.strip() for v in value.split(",") if v.strip()]
    unknown = sorted(
        v for v in variants if v not in CONVERGENCE_VARIANTS and not v.startswith("DiLoCo-")
    )
    unknown += sorted(v for v in variants if v.startswith("DiLoCo-") and not is_variant(v))
    if unknown:
        parser.error(
            f"unknown optimizer(s) {unknown}; choose from {list(CONVERGENCE_VARIANTS)} or a "
            "DiLoCo label (experiments/harness/training.py)"
        )
    return variants


def task_hyper(task: str, **overrides: Any) -> Hyper:
    """The suite's hyper-parameters for ``task`` (:data:`DEFAULTS`, β2 = 0.99, ZeroOneAdam's
    local interval doubling every steps // 4 steps), with ``overrides`` (``None``: the default)."""
    d = DEFAULTS[task]
    kw: dict[str, Any] = dict(
        lr=d["lr"], lamb_lr=d["lamb_lr"], warmup=d["warmup"], steps=d["steps"], betas=(0.9, 0.99)
    )
    kw.update({k: v for k, v in overrides.items() if v is not None})
    kw.setdefault("local_step_scaler", max(1, kw["steps"] // 4))
    return Hyper(**kw)


def _row(
    setup: Setup, step: int, hp: Hyper, val: tuple[float, float] | None, train_time: float
) -> dict[str, Any]:
    return dict(
        step=step,
        stage=setup.stage(step, hp) if step else "init",
        train_loss=math.nan,
        val_loss=val[0] if val else None,
        val_metric=val[1] if val else None,
        bytes_sent=setup.bytes_sent,
        collectives=setup.collectives,
        comm_steps=setup.comm_steps,
        train_time_s=train_time,
    )


def _train_variant(
    task: Any, setup: Setup, hp: Hyper, eval_every: int, bar: Any
) -> tuple[list[dict[str, Any]], list[float]]:
    """One variant through :func:`train_on_task`: a row per step (and the initial one), and
    this rank's training losses."""
    rows: list[dict[str, Any]] = []

    def record(step: int, val: tuple[float, float] | None, train_time: float) -> None:
        rows.append(_row(setup, step, hp, val, train_time))
        if bar is not None and step:
            bar.update(1)
            if val is not None:
                bar.set_postfix(val_loss=f"{rows[-1]['val_loss']:.3f}", stage=rows[-1]["stage"])

    losses = train_on_task(task, setup, hp.steps, eval_every, record, evaluate_first=True)
    return rows, losses


def train_variants(
    task_name: str,
    task_overrides: dict[str, Any],
    hp: Hyper,
    variants: list[str],
    eval_every: int,
    progress: bool,
) -> dict[str, Any]:
    """Run on every rank: train each variant in turn. Returns the rows and summaries."""
    task = load_task(task_name, **task_overrides)
    rank = dist.get_rank() if dist.is_initialized() else 0
    n = dist.get_world_size() if dist.is_initialized() else 1
    out: dict[str, Any] = {"describe": task.describe(), "world_size": n, "runs": {}}
    for label in variants:
        setup = make_setup(label, task.build_model(), hp)
        bar = None
        if progress and rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=hp.steps, desc=f"{task_name} {label:<12}", unit="step", leave=True)

        rows, losses = _train_variant(task, setup, hp, eval_every, bar)
        if bar is not None:
            bar.close()
        mean_losses = [x / n for x in sum_over_ranks(losses)]
        for row, value in zip(rows[1:], mean_losses, strict=True):
            row["train_loss"] = value
        identical = replicas_identical(setup.model)
        setup.close()
        out["runs"][label] = {"rows": rows, "identical": identical}
    return out


# -- outputs (rank 0) ----------------------------------------------------------------------------
def _write_csv(path: pathlib.Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=_FIELDS)
        w.writeheader()
        for row in rows:
            w.writerow({k: ("" if row[k] is None else row[k]) for k in _FIELDS})


def _plot(path: pathlib.Path, result: dict[str, Any], task: str, metric_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, run in result["runs"].items():
        pts = [r for r in run["rows"] if r["val_loss"] is not None]
        ax1.plot([r["step"] for r in pts], [r["val_loss"] for r in pts], label=label)
        sent = [r for r in pts if r["bytes_sent"] > 0]
        ax2.plot([r["bytes_sent"] / 1e6 for r in sent], [r["val_loss"] for r in sent], label=label)
    ax1.set_xlabel("step")
    ax2.set_xlabel("MB sent per rank (ring model, log scale)")
    ax2.set_xscale("log")
    for ax in (ax1, ax2):
        ax.set_ylabel("validation loss (nats)")
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle(f"{task}: {result['world_size']} ranks ({metric_name} in summary.md)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _summary(result: dict[str, Any], hp: Hyper, metric_name: str, machine: str) -> str:
    runs = result["runs"]
    base = runs.get("Adam")
    base_bytes = base["rows"][-1]["bytes_sent"] if base else None
    lines = [
        f"{result['describe']}",
        "",
        f"{result['world_size']} ranks, {hp.steps} steps, warmup/freeze step {hp.warmup}, "
        f"lr {hp.lr} (Adam family), {hp.lamb_lr} (LAMB family), betas {hp.betas}, PowerSGD rank "
        f"{hp.powersgd_rank}; ZeroOneAdam var_update_scaler {hp.var_update_scaler}, "
        f"local_step_scaler {hp.local_step_scaler}, local_step_clipper {hp.local_step_clipper}"
        + (
            "; the papers' rules (ZeroOneAdam without bias correction, OnebitLamb frozen trust "
            "ratios)."
            if hp.rules == "papers"
            else "."
        ),
        f"Machine: {machine}.",
        "",
        f"| variant | final val loss | final {metric_name} | best {metric_name} "
        "| MB sent/rank | Adam bytes / these | collectives | steps with data exchange "
        "| train time s | ms/step | replicas identical at end |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, run in runs.items():
        rows = run["rows"]
        last = rows[-1]
        evals = [r for r in rows if r["val_metric"] is not None]
        best = (max if "accuracy" in metric_name else min)(r["val_metric"] for r in evals)
        total = last["bytes_sent"]
        ratio = f"{base_bytes / total:.1f}x" if base_bytes and total else "-"
        lines.append(
            f"| {label} | {last['val_loss']:.4f} | {last['val_metric']:.3f} | {best:.3f} "
            f"| {total / 1e6:.2f} | {ratio} | {last['collectives']} | {last['comm_steps']} "
            f"| {last['train_time_s']:.1f} | {1e3 * last['train_time_s'] / hp.steps:.1f} "
            f"| {'yes' if run['identical'] else 'no'} |"
        )
    lines += [
        "",
        "MB sent/rank: modelled bytes one rank sends during training (ring all_reduce "
        "2(n-1)/n·B, commopt's counters; DDP hooks: every all_reduce the hook issues). "
        "Collectives: collective calls (each at least one network round trip). Time: wall "
        "time of forward+backward+communication+update on rank 0, evaluation excluded, "
        "ranks sharing this machine's cores.",
    ]
    return "\n".join(lines) + "\n"


def write_outputs(
    result: dict[str, Any], out_dir: pathlib.Path, task: str, hp: Hyper, metric_name: str
) -> pathlib.Path:
    """CSV per variant, curves.png and summary.md under ``out_dir/task``; returns the folder."""
    folder = out_dir / task
    folder.mkdir(parents=True, exist_ok=True)
    for label, run in result["runs"].items():
        _write_csv(folder / f"{label}.csv", run["rows"])
    _plot(folder / "curves.png", result, task, metric_name)
    (folder / "summary.md").write_text(_summary(result, hp, metric_name, describe_machine()))
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=["lm", "digits", "all"], default="all")
    parser.add_argument("--world-size", type=int, default=4, help="forked ranks (no launcher)")
    parser.add_argument(
        "--optimizers",
        default=",".join(CONVERGENCE_VARIANTS),
        help=f"comma-separated subset of {list(CONVERGENCE_VARIANTS)}",
    )
    parser.add_argument("--steps", type=int, help="override the task's default")
    parser.add_argument("--warmup", type=int, help="freeze step of the compressed optimizers")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--lamb-lr", type=float)
    parser.add_argument("--eval-every", type=int)
    parser.add_argument(
        "--beta2",
        type=float,
        default=0.99,
        help="β2 of every variant (default 0.99: with 0.999 the variance would still be far "
        "from settled at the freeze step of a run this short)",
    )
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument(
        "--local-step-scaler",
        type=int,
        help="ZeroOneAdam: phase-B steps between doublings of the local interval "
        "(default: steps // 4, so the interval reaches 8 in a short run)",
    )
    parser.add_argument("--local-step-clipper", type=int, default=16)
    parser.add_argument(
        "--rules",
        choices=("default", "papers"),
        default="default",
        help="papers: ZeroOneAdam bias_correction=False, OnebitLamb trust_ratio='frozen' "
        "(the papers' rules where commopt's defaults go beyond them)",
    )
    parser.add_argument("--var-update-scaler", type=int, default=16)
    parser.add_argument(
        "--task-arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a task field, e.g. --task-arg d=32 --task-arg batch_per_rank=8",
    )
    parser.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results"
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--timeout", type=float, default=7200.0)
    args = parser.parse_args(argv)
    variants = parse_variants(parser, args.optimizers)
    overrides: dict[str, Any] = {}
    for item in args.task_arg:
        name, _, value = item.partition("=")
        if not value:
            parser.error(f"--task-arg {item!r}: expected NAME=VALUE")
        overrides[name] = type(_task_default(args.task, name))(value)

    for task in ["lm", "digits"] if args.task == "all" else [args.task]:
        hp = task_hyper(
            task,
            lr=args.lr,
            lamb_lr=args.lamb_lr,
            warmup=args.warmup,
            steps=args.steps,
            betas=(0.9, args.beta2),
            powersgd_rank=args.powersgd_rank,
            var_update_scaler=args.var_update_scaler,
            local_step_scaler=args.local_step_scaler,
            local_step_clipper=args.local_step_clipper,
            rules=args.rules,
        )
        fields = {f.name for f in dataclasses.fields(TASKS[task])}
        mine = {k: v for k, v in overrides.items() if k in fields}
        t0 = time.perf_counter()
        result = launch(
            train_variants,
            args.world_size,
            task,
            mine,
            hp,
            variants,
            args.eval_every or DEFAULTS[task]["eval_every"],
            not args.no_progress,
            timeout=args.timeout,
        )
        if result is None:  # not rank 0 under a launcher
            continue
        metric = load_task_metric(task)
        folder = write_outputs(result, args.out, task, hp, metric)
        print((folder / "summary.md").read_text())
        print(f"{task}: wrote {folder} in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


def _task_default(task: str, name: str) -> Any:
    from experiments.harness.tasks import TASKS

    tasks = list(TASKS) if task == "all" else [task]
    for t in tasks:
        fields = {f.name: f.default for f in dataclasses.fields(TASKS[t])}
        if name in fields:
            return fields[name]
    raise SystemExit(f"--task-arg: {name!r} is not a field of task(s) {tasks}")


def load_task_metric(task: str) -> str:
    from experiments.harness.tasks import TASKS

    return next(f.default for f in dataclasses.fields(TASKS[task]) if f.name == "metric_name")


if __name__ == "__main__":
    sys.exit(main())
