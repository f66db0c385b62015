r"""What the experiments on options beyond the papers share: train named optimizer variants
on a convergence task.

A *maker* builds the optimizer on every rank: ``maker(params, backend) -> Optimizer``. Each
variant starts from the same weights (rank 0's, broadcast), sees the same batches in the same
order (the task's), and is evaluated on the same validation set; rows record the validation
loss and metric on evaluation steps, bytes sent by this rank and, for commopt optimizers, the
freeze step actually used.
"""

from __future__ import annotations

import math
import pathlib
import time
from collections.abc import Callable
from typing import Any

import torch

import commopt
from commopt.comm import TorchBackend
from experiments.harness import Setup, describe_machine, launch, replicas_identical, train_on_task
from experiments.harness.tasks import load_task

__all__ = ["Maker", "plot_curves", "run_variants", "write_table"]

Maker = Callable[[list[torch.nn.Parameter], Any], torch.optim.Optimizer]


def _train_variant(task: Any, setup: Setup, steps: int, eval_every: int) -> list[dict[str, Any]]:
    """One variant through :func:`train_on_task`: a row per evaluation step."""
    rows: list[dict[str, Any]] = []

    def record(step: int, val: tuple[float, float] | None, train_time: float) -> None:
        del train_time
        if val is not None:
            rows.append(dict(step=step, val_loss=val[0], metric=val[1], bytes=setup.bytes_sent))

    train_on_task(task, setup, steps, eval_every, record)
    return rows


def _train(
    task_name: str,
    overrides: dict[str, Any],
    makers: dict[str, Maker],
    steps: int,
    eval_every: int,
    task_factory: Callable[..., Any] | None,
) -> dict[str, Any]:
    task = task_factory(**overrides) if task_factory else load_task(task_name, **overrides)
    out: dict[str, Any] = {"describe": task.describe(), "runs": {}}
    for label, make in makers.items():
        model = task.build_model()
        backend = TorchBackend()
        commopt.broadcast_parameters(model, backend=backend)
        backend.stats.reset()
        opt = make(list(model.parameters()), backend)
        plain = not isinstance(opt, commopt.optim.base.CompressedOptimizer)
        setup = Setup(label, model, opt, backend, None, average_gradients=plain)
        t0 = time.perf_counter()
        rows = _train_variant(task, setup, steps, eval_every)
        seconds = time.perf_counter() - t0
        identical = replicas_identical(model)
        info: dict[str, Any] = {"rows": rows, "seconds": seconds, "identical": identical}
        if hasattr(opt, "frozen_after"):
            frozen = opt.frozen_after()
            info["freeze_step"] = None if math.isinf(frozen) else int(frozen)
        out["runs"][label] = info
    out["machine"] = describe_machine()
    out["task_metric"] = task.metric_name
    return out


def run_variants(
    task_name: str,
    makers: dict[str, Maker],
    steps: int,
    eval_every: int,
    world_size: int = 4,
    overrides: dict[str, Any] | None = None,
    task_factory: Callable[..., Any] | None = None,
) -> dict[str, Any]:
    """Train every variant on ``world_size`` forked gloo ranks; rank 0's results."""
    return launch(
        _train,
        world_size,
        task_name,
        overrides or {},
        makers,
        steps,
        eval_every,
        task_factory,
        timeout=7200.0,
    )


def write_table(result: dict[str, Any], path: pathlib.Path, title: str, note: str = "") -> str:
    """A markdown table of final validation loss/metric, bytes and freeze step per variant."""
    lines = [
        f"## {title}",
        "",
        result["describe"],
        "",
        f"Machine: {result['machine']}.",
        "",
        f"| variant | final val loss | final {result['task_metric']} | MB sent/rank "
        "| freeze step | train s | replicas identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, run in result["runs"].items():
        last = run["rows"][-1]
        freeze = run.get("freeze_step")
        lines.append(
            f"| {label} | {last['val_loss']:.4f} | {last['metric']:.3f} "
            f"| {last['bytes'] / 1e6:.2f} | {'-' if freeze is None else freeze} "
            f"| {run['seconds']:.0f} | {'yes' if run['identical'] else 'no'} |"
        )
    if note:
        lines += ["", note]
    text = "\n".join(lines) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


def plot_curves(result: dict[str, Any], path: pathlib.Path, title: str) -> None:
    """Validation loss against step, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, run in result["runs"].items():
        rows = run["rows"]
        ax.plot([r["step"] for r in rows], [r["val_loss"] for r in rows], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
