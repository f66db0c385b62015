# ruff: noqa: E402  (torch is imported after its CPU kernels are capped, below)
r"""DiLoCo against per-step communication, at equal inner steps and equal data, over seeds.

    python -m experiments.diloco.convergence --task lm --seeds 0,1,2
    python -m experiments.diloco.convergence --task digits --seeds 0,1,2

The convergence suite's tasks and settings (:mod:`experiments.convergence.run`: 4 forked gloo
ranks, 300 steps, lr 3e-3 / 2e-3, β = (0.9, 0.99)); every DiLoCo row wraps the ``Adam`` row's
optimizer with its gradients left local (labels: :mod:`experiments.harness.training`). Writes
``--out``/<task>.md: per variant the final validation loss (mean over seeds ± sd), the gap to
Adam with per-step all-reduce and to ``DiLoCo-none`` at the same H, the bits one rank sent per
parameter per inner step (SPEC §7's cost model, commopt's byte counters), and whether the
replicas were bit-identical at the end of every seed's run (300 is a multiple of every H, so
the last step is a sync).
"""

from __future__ import annotations

from experiments.cpu_isa import cap_at_avx2

cap_at_avx2()  # before torch loads: the losses reported move with an ulp (see there)

import argparse
import json
import pathlib
import re
import statistics
import sys
import time

from commopt.diloco import default_fp32_syncs
from experiments.convergence.run import DEFAULTS, task_hyper, train_variants
from experiments.harness import describe_machine, launch
from experiments.harness.tasks import load_task

__all__ = ["default_variants", "main", "table"]

OUT = pathlib.Path(__file__).parent / "results"


def default_variants(sync_every: list[int]) -> list[str]:
    """The issue's rows: the per-step baselines, each compression at each H, streaming."""
    rows = ["Adam", "OnebitAdam", "ZeroOneAdam"]
    for c in ("none", "bf16"):
        rows += [f"DiLoCo-{c}-H{h}" for h in sync_every]
    # commopt's defaults: one scale per tensor, the syncs of the first 50 steps (two at least) at
    # fp32; the labels spell the fp32 syncs out, as a label without -fS has none
    rows += [f"DiLoCo-onebit-H{h}-f{default_fp32_syncs('onebit', h)}-tensor" for h in sync_every]
    return [*rows, f"DiLoCo-onebit-H50-P4-f{default_fp32_syncs('onebit', 50)}-tensor"]


def _h(label: str) -> str | None:
    m = re.match(r"DiLoCo-\w+-(H\d+)", label)
    return m[1] if m else None


def table(finals: dict[str, list[float]], bits: dict[str, float], same: dict[str, bool]) -> str:
    """The markdown table of the module docstring."""
    adam = statistics.fmean(finals["Adam"]) if "Adam" in finals else None
    lines = [
        "| variant | final val loss (mean ± sd) | vs Adam | vs DiLoCo-none, same H "
        "| bits/param/step | replicas identical |",
        "|---|---|---|---|---|---|",
    ]
    for label, values in finals.items():
        mean = statistics.fmean(values)
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        vs_adam = f"{100 * (mean / adam - 1):+.1f} %" if adam and label != "Adam" else "–"
        none = f"DiLoCo-none-{_h(label)}" if _h(label) else None
        vs_none = "–"
        if none in finals and none != label:
            vs_none = f"{100 * (mean / statistics.fmean(finals[none]) - 1):+.1f} %"
        lines.append(
            f"| {label} | {mean:.4f} ± {sd:.4f} | {vs_adam} | {vs_none} | {bits[label]:.4f} "
            f"| {'yes' if same[label] else 'no'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(DEFAULTS), default="lm")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--sync-every", default="10,50,100", help="the H of the DiLoCo rows")
    parser.add_argument("--optimizers", help="comma-separated labels (default: the issue's rows)")
    parser.add_argument("--steps", type=int, help="override the task's default")
    parser.add_argument("--lr", type=float, help="every row's Adam lr (default: the task's)")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    parser.add_argument("--timeout", type=float, default=7200.0)
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    hs = [int(h) for h in args.sync_every.split(",")]
    variants = args.optimizers.split(",") if args.optimizers else default_variants(hs)
    hp = task_hyper(args.task, steps=args.steps, lr=args.lr)
    params = sum(p.numel() for p in load_task(args.task).build_model().parameters())

    t0 = time.perf_counter()
    finals: dict[str, list[float]] = {}
    bits: dict[str, float] = {}
    same: dict[str, bool] = {}
    describe = ""
    for seed in seeds:
        result = launch(
            train_variants,
            args.world_size,
            args.task,
            {"seed": seed},
            hp,
            variants,
            DEFAULTS[args.task]["eval_every"],
            False,
            timeout=args.timeout,
        )
        if result is None:  # not rank 0 under a launcher
            return 0
        describe = result["describe"]
        for label, run in result["runs"].items():
            last = run["rows"][-1]
            finals.setdefault(label, []).append(last["val_loss"])
            bits[label] = 8 * last["bytes_sent"] / (params * hp.steps)
            same[label] = same.get(label, True) and run["identical"]
        print(f"{args.task} seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)

    text = "\n".join(
        [
            describe,
            "",
            f"{args.world_size} ranks, {hp.steps} inner steps, seeds {seeds}; Adam lr {hp.lr}, "
            f"betas {hp.betas} for every row (DiLoCo's inner optimizer too); 1-bit Adam freeze "
            f"step and 0/1 Adam variance freeze {hp.warmup}. Command: `python -m "
            f"experiments.diloco.convergence --task {args.task} --seeds {args.seeds}"
            + (f" --steps {args.steps}" if args.steps else "")
            + (f" --lr {args.lr:g}" if args.lr else "")
            + (f" --optimizers {args.optimizers}" if args.optimizers else "")
            + "`.",
            f"Machine: {describe_machine()}; {time.perf_counter() - t0:.0f} s wall.",
            "",
            table(finals, bits, same),
            "",
            "Per seed: " + json.dumps({k: [round(v, 4) for v in vs] for k, vs in finals.items()}),
        ]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    name = args.task if not args.optimizers else f"{args.task}-{len(variants)}-variants"
    name += f"-lr{args.lr:g}" if args.lr else ""
    (args.out / f"{name}.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
