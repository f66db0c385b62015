r"""Automatic freeze point against a sweep of five fixed freeze steps (1-bit Adam).

    python -m experiments.algorithms.freeze --task lm --out experiments/algorithms/results
    python -m experiments.algorithms.freeze --task digits --seeds 0,1,2,3,4 --out …

4 forked gloo ranks; the convergence suite's tasks, steps, lr and β2 = 0.99 (its defaults,
experiments/convergence/run.py). Variants: OnebitAdam(freeze_step=F) for F in --sweep and
OnebitAdam(freeze_step="auto"). Writes freeze_<task>[_seedS].md and .png into ``--out``, and
with several seeds freeze_<task>_seeds.md (every seed, mean ± sample std, and each variant's gap
to the best fixed step per seed, so every arm is compared on the same seeds).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import commopt
from experiments.algorithms.common import plot_curves, run_variants, write_table
from experiments.convergence.run import DEFAULTS

OUT = pathlib.Path(__file__).parent / "results"


def makers(lr: float, beta2: float, sweep: list[int]) -> dict:
    def onebit(freeze):
        return lambda params, be: commopt.OnebitAdam(
            params, lr=lr, betas=(0.9, beta2), freeze_step=freeze, backend=be
        )

    out = {f"OnebitAdam F={f}": onebit(f) for f in sweep}
    out["OnebitAdam auto"] = onebit("auto")
    return out


def seed_summary(
    finals: dict[str, list[float]], seeds: list[int], auto: list[tuple[int | None, float]]
) -> str:
    """Every seed's final loss, mean ± sample std, and two paired gaps (per seed, then mean ± std
    over the seeds): to that seed's best fixed step, and to the fixed step that is best on
    average (the same arm on every seed: the comparison the goal asks for)."""
    fixed = [k for k in finals if "auto" not in k]
    best = [min(finals[k][i] for k in fixed) for i in range(len(seeds))]
    best_arm = min(fixed, key=lambda k: statistics.fmean(finals[k]))
    lines = [
        "| variant | "
        + " | ".join(f"seed {s}" for s in seeds)
        + " | mean ± std | gap to the seed's best fixed step | "
        + f"gap to {best_arm} (best on average), paired | seeds above it |",
        "|---|" + "---|" * (len(seeds) + 4),
    ]
    for k, vals in finals.items():
        gaps = [100 * (v / b - 1) for v, b in zip(vals, best, strict=True)]
        paired = [100 * (v / b - 1) for v, b in zip(vals, finals[best_arm], strict=True)]
        cells = " | ".join(f"{v:.4f}" for v in vals)
        lines.append(
            f"| {k} | {cells} | {statistics.fmean(vals):.4f} ± {statistics.stdev(vals):.4f} "
            f"| {statistics.fmean(gaps):+.1f} % ± {statistics.stdev(gaps):.1f} % "
            f"| {statistics.fmean(paired):+.1f} % ± {statistics.stdev(paired):.1f} % "
            f"| {sum(g > 0 for g in paired)}/{len(seeds)} |"
        )
    steps = ", ".join(
        f"seed {s}: {'did not freeze' if f is None else f'step {f}'} ({mb:.1f} MB)"
        for s, (f, mb) in zip(seeds, auto, strict=True)
    )
    lines += ["", f"Auto: {steps}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=["lm", "digits", "all"], default="all")
    parser.add_argument("--sweep", default="15,30,60,120,200")
    parser.add_argument("--beta2", type=float, default=0.99)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--seeds", default="0", help="task seeds (model init and batches)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sweep = [int(s) for s in args.sweep.split(",") if s.strip()]
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    for task in ["lm", "digits"] if args.task == "all" else [args.task]:
        d = DEFAULTS[task]
        steps = args.steps or d["steps"]
        chosen = makers(d["lr"], args.beta2, sweep)
        finals: dict[str, list[float]] = {k: [] for k in chosen}
        auto_runs: list[tuple[int | None, float]] = []  # (freeze step, MB sent) per seed
        for seed in seeds:
            result = run_variants(
                task, chosen, steps, d["eval_every"], args.ranks, overrides={"seed": seed}
            )
            for k, r in result["runs"].items():
                finals[k].append(r["rows"][-1]["val_loss"])
            runs = result["runs"]
            fixed = [r["rows"][-1]["val_loss"] for k, r in runs.items() if "auto" not in k]
            auto = result["runs"]["OnebitAdam auto"]
            auto_runs.append((auto["freeze_step"], auto["rows"][-1]["bytes"] / 1e6))
            froze = (
                f"Auto froze at step {auto['freeze_step']}"
                if auto["freeze_step"] is not None
                else f"Auto did not freeze within the {steps} steps"
            )
            note = (
                f"{steps} steps, lr {d['lr']}, betas (0.9, {args.beta2}), {args.ranks} ranks, "
                f"seed {seed}. {froze}"
            )
            if fixed:
                gap = 100 * (auto["rows"][-1]["val_loss"] / min(fixed) - 1)
                note += f"; its final validation loss is {gap:+.2f} % from the best fixed step."
            tag = "" if len(seeds) == 1 else f"_seed{seed}"
            print(
                write_table(
                    result, args.out / f"freeze_{task}{tag}.md", f"Auto freeze: {task}", note
                )
            )
            plot_curves(result, args.out / f"freeze_{task}{tag}.png", f"1-bit Adam freeze: {task}")
        if len(seeds) > 1:
            text = seed_summary(finals, seeds, auto_runs)
            (args.out / f"freeze_{task}_seeds.md").write_text(text)
            print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
