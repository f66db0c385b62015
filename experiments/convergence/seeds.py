# ruff: noqa: E402  (torch is imported after its CPU kernels are capped, below)
r"""How much of a convergence table is the seed? Every variant over several seeds.

    python -m experiments.convergence.seeds --task digits --seeds 0,1,2,3,4

The convergence suite (:mod:`experiments.convergence.run`) runs one seed, and on digits its
final validation loss moves by up to 0.015 from last-bit rounding alone (docs/experiments.md
§1). This runs the suite's variants, with its settings, once per task seed (the seed draws the
model's initialization and the minibatch order; the split is fixed), and the variants whose
defaults go beyond their papers once more with the papers' rules (``--rules papers``: 0/1 Adam
without bias correction, 1-bit LAMB with frozen trust ratios). Writes ``seeds.md`` into
``--out``/<task>/: the final validation loss per seed, the mean, and the mean paired difference
to Adam's run on the same seed with its standard error:

    d̄ = (1/S)·Σ_s (L_s − L_s^Adam)     se = sd_s(L_s − L_s^Adam)/√S
"""

from __future__ import annotations

from experiments.cpu_isa import cap_at_avx2

cap_at_avx2()  # before torch loads: the losses reported move with an ulp (see there)

import argparse
import pathlib
import statistics
import sys
import time

from experiments.convergence.run import (
    CONVERGENCE_VARIANTS,
    DEFAULTS,
    parse_variants,
    task_hyper,
    train_variants,
)
from experiments.harness import describe_machine, launch

__all__ = ["main", "seed_table"]

OUT = pathlib.Path(__file__).parent / "results"
#: variants whose defaults go beyond the papers; run once more with ``rules="papers"``
PAPER_RULES = ("ZeroOneAdam", "OnebitLamb")


def seed_table(losses: dict[str, list[float]], seeds: list[int]) -> list[str]:
    """Markdown rows: each variant's final losses per seed, their mean, and the mean paired
    difference to ``losses["Adam"]`` with its standard error."""
    adam = losses.get("Adam")
    head = "| variant | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | − Adam (± se) |"
    lines = [head, "|---" * (len(seeds) + 3) + "|"]
    for label, values in losses.items():
        cells = " | ".join(f"{v:.4f}" for v in values)
        diff = "–"
        if adam is not None and label != "Adam":
            d = [v - a for v, a in zip(values, adam, strict=True)]
            se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
            diff = f"{statistics.fmean(d):+.4f} ± {se:.4f}"
        lines.append(f"| {label} | {cells} | {statistics.fmean(values):.4f} | {diff} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(DEFAULTS), default="digits")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--optimizers", default=",".join(CONVERGENCE_VARIANTS))
    parser.add_argument("--steps", type=int, help="override the task's default")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    parser.add_argument("--timeout", type=float, default=7200.0)
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = parse_variants(parser, args.optimizers)
    runs = [("default", variants)]
    papers = [v for v in variants if v in PAPER_RULES]
    if papers:
        runs.append(("papers", papers))

    t0 = time.perf_counter()
    losses: dict[str, list[float]] = {}
    describe = ""
    for rules, labels in runs:
        hp = task_hyper(args.task, steps=args.steps, rules=rules)
        eval_every = DEFAULTS[args.task]["eval_every"]
        for seed in seeds:
            result = launch(
                train_variants,
                args.world_size,
                args.task,
                {"seed": seed},
                hp,
                labels,
                eval_every,
                False,
                timeout=args.timeout,
            )
            if result is None:  # not rank 0 under a launcher
                return 0
            describe = result["describe"]
            for label, run in result["runs"].items():
                name = label if rules == "default" else f"{label} (papers' rules)"
                losses.setdefault(name, []).append(run["rows"][-1]["val_loss"])
            print(
                f"{args.task} seed {seed} ({rules}): {time.perf_counter() - t0:.0f} s", flush=True
            )
    hp = task_hyper(args.task, steps=args.steps)
    lines = [
        describe,
        "",
        f"Final validation loss after {hp.steps} steps, {args.world_size} ranks, the settings "
        f"of `experiments.convergence.run --task {args.task}` (freeze/warmup {hp.warmup}, lr "
        f"{hp.lr} Adam family / {hp.lamb_lr} LAMB family, betas {hp.betas}); one column per "
        'task seed (initialization and minibatch order). "papers\' rules": 0/1 Adam with '
        "bias_correction=False, 1-bit LAMB with trust_ratio='frozen'.",
        f"Machine: {describe_machine()}; {time.perf_counter() - t0:.0f} s wall.",
        "",
        *seed_table(losses, seeds),
    ]
    folder = args.out / args.task
    folder.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + "\n"
    (folder / "seeds.md").write_text(text)
    print(text)
    print(f"wrote {folder / 'seeds.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
