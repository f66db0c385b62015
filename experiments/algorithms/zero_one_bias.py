r"""0/1 Adam's bias correction on the demo's byte LM, against Adam.

    python -m experiments.algorithms.zero_one_bias --seeds 0,1 --out experiments/algorithms/results

The demo's byte LM (experiments/demo/train_bytelm.py: 300 steps, lr 2e-3), 4 ranks, the guard
experiment's 0/1 Adam schedule (var_freeze_step 75, var_update_scaler 16, local_step_scaler
steps//4, local_step_clipper 16) and 0/1 Adam's literal default var_freeze_step = 100000 (phase A,
1-bit gradients and thinning fp32 variance steps, for the whole run), each with
``bias_correction`` off (SPEC §4: m and v as they are) and on (v̂ = v/(1 − β2^k), k the
variance updates, m̂ = m/(1 − β1^t)), at the paper's
β2 = 0.999 and at the demo's 0.96. Every row uses the default step guard ("tiny") and the
zero-variance mask. torch.optim.Adam (β2 = 0.999, fp32-averaged gradients) is the reference.
Writes ``zero_one_bias.md`` (one column per seed, the mean, and the mean's distance to Adam's)
into ``--out``.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

import torch

import commopt
from experiments.algorithms.demo_lm import SMALL, seed_table, train_variants
from experiments.harness import bytelm, describe_machine, launch

OUT = pathlib.Path(__file__).parent / "results"
DEFAULT_FREEZE = 100_000


def _zero_one(beta2: float, correct: bool, freeze: int | None):
    def build(params, cfg):
        return commopt.ZeroOneAdam(
            params,
            lr=cfg.lr,
            betas=(0.9, beta2),
            var_freeze_step=cfg.warmup if freeze is None else freeze,
            var_update_scaler=16,
            local_step_scaler=max(1, cfg.steps // 4),
            local_step_clipper=16,
            bias_correction=correct,
        )

    return build


def _label(beta2: float, correct: bool, freeze: int | None) -> str:
    where = "T_v=75" if freeze is None else f"T_v={freeze}"
    return f"ZeroOneAdam β2={beta2} {where} bias_correction={'on' if correct else 'off'}"


ADAM = "Adam"
VARIANTS: dict[str, Any] = {
    ADAM: None,
    **{
        _label(b2, c, f): _zero_one(b2, c, f)
        for f in (None, DEFAULT_FREEZE)
        for b2 in (0.999, 0.96)
        for c in (False, True)
    },
}


def _variant(label: str) -> bytelm.Variant:
    if label == ADAM:
        return bytelm.Variant(
            ADAM,
            lambda params, cfg: torch.optim.Adam(params, lr=cfg.lr),
            True,
            None,
            "torch.optim.Adam",
        )
    return bytelm.Variant(label, VARIANTS[label], False, lambda c: c.warmup + 1, label)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated labels")
    parser.add_argument("--seeds", default="0", help="demo seeds (model init and batches)")
    parser.add_argument("--steps", type=int, default=bytelm.Config.steps)
    parser.add_argument("--warmup", type=int, default=bytelm.Config.warmup, help="T_v of the rows")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--small", action="store_true", help="a tiny model and corpus (tests)")
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    args = parser.parse_args(argv)
    labels = [k for k in args.variants.split(",") if k]
    seeds = [int(s) for s in args.seeds.split(",")]
    extra = SMALL if args.small else {}
    per_seed = {}
    for seed in seeds:
        cfg = bytelm.Config(steps=args.steps, warmup=args.warmup, seed=seed, **extra)
        variants = [_variant(label) for label in labels]
        per_seed[seed] = launch(train_variants, args.ranks, variants, cfg, timeout=7200.0)
        print(seed, {k: v for k, v in per_seed[seed].items() if k != "_machine"}, flush=True)
    lines = [
        "## 0/1 Adam's bias correction on the demo byte LM",
        "",
        f"Machine: {describe_machine()}. Steps {args.steps}, {args.ranks} ranks, "
        f"seeds {args.seeds}; T_v = {args.warmup} is the demo's warmup.",
        "",
        *seed_table(per_seed, labels, reference=ADAM),
    ]
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "zero_one_bias.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
