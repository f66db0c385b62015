r"""The step guard on the demo's byte LM: 0/1 Adam at the paper's β2 = 0.999 and what it costs.

    python -m experiments.algorithms.guard --out experiments/algorithms/results [--seeds 0,1]

The demo's byte LM (experiments/demo/train_bytelm.py: 300 steps, warmup / var_freeze_step 75,
lr 2e-3, the demo's ZeroOneAdam schedule), 4 ranks. Every row keeps commopt's zero-variance
guard (SPEC §8). ``step_guard`` rows: ``tiny`` (the default: clamp |m/(√v+ε)| ≤ B(β1, β2) only
where v < 1 % of the tensor's mean v), ``all`` (``True``: every element), ``off`` (``False``:
the papers' step), and an ε floor (ε = 1e-6, guard off). 0/1 Adam at β2 = 0.999 (the paper's)
and 0.96 (the demo's 1 − 3/T_v); 1-bit Adam and 1-bit LAMB at their defaults, guard on and off,
to see what the default costs where nothing diverges. 0/1 Adam runs with
``bias_correction=False`` (SPEC §4, the default when this was measured): the guard is measured
on the uncorrected v it was made for; experiments/algorithms/zero_one_bias.py measures the
correction. Writes ``guard.md`` (one table per seed and a mean over seeds) into ``--out``.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

import commopt
from experiments.algorithms.demo_lm import SMALL, run_demo_variants, seed_table
from experiments.harness import bytelm

OUT = pathlib.Path(__file__).parent / "results"
GUARDS: dict[str, Any] = {"tiny": "tiny", "all": True, "off": False}


def _zero_one(beta2: float, guard: Any, eps: float = 1e-8):
    def build(params, cfg):
        return commopt.ZeroOneAdam(
            params,
            lr=cfg.lr,
            betas=(0.9, beta2),
            eps=eps,
            var_freeze_step=cfg.warmup,
            var_update_scaler=16,
            local_step_scaler=max(1, cfg.steps // 4),
            local_step_clipper=16,
            step_guard=guard,
            bias_correction=False,
        )

    return build


def _onebit_adam(guard: Any):
    def build(params, cfg):
        return commopt.OnebitAdam(params, lr=cfg.lr, freeze_step=cfg.warmup, step_guard=guard)

    return build


def _onebit_lamb(guard: Any):
    def build(params, cfg):
        return commopt.OnebitLamb(params, lr=5 * cfg.lr, freeze_step=cfg.warmup, step_guard=guard)

    return build


VARIANTS = {
    **{f"ZeroOneAdam β2=0.999 guard={k}": _zero_one(0.999, g) for k, g in GUARDS.items()},
    "ZeroOneAdam β2=0.999 guard=off eps=1e-6": _zero_one(0.999, False, eps=1e-6),
    **{f"ZeroOneAdam β2=0.96 guard={k}": _zero_one(0.96, g) for k, g in GUARDS.items()},
    **{f"OnebitAdam guard={k}": _onebit_adam(g) for k, g in GUARDS.items() if k != "all"},
    **{f"OnebitLamb guard={k}": _onebit_lamb(g) for k, g in GUARDS.items() if k != "all"},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated labels")
    parser.add_argument("--seeds", default="0", help="demo seeds (model init and batches)")
    parser.add_argument("--steps", type=int, default=bytelm.Config.steps)
    parser.add_argument("--warmup", type=int, default=bytelm.Config.warmup)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--small", action="store_true", help="a tiny model and corpus (tests)")
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    args = parser.parse_args(argv)
    chosen = {k: VARIANTS[k] for k in args.variants.split(",") if k}
    seeds = [int(s) for s in args.seeds.split(",")]
    extra = SMALL if args.small else {}
    per_seed = {}
    for seed in seeds:
        cfg = bytelm.Config(steps=args.steps, warmup=args.warmup, seed=seed, **extra)
        per_seed[seed] = run_demo_variants(chosen, cfg, world_size=args.ranks)
    first = per_seed[seeds[0]]
    lines = [
        "## The step guard on the demo byte LM",
        "",
        f"Machine: {first['_machine']}. Steps {args.steps}, warmup {args.warmup}, "
        f"{args.ranks} ranks, seeds {args.seeds}.",
        "",
        *seed_table(per_seed, list(chosen)),
    ]
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "guard.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
