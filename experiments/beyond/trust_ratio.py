r"""1-bit LAMB with frozen (SPEC §3), tracking and max trust ratios, and LAMB, on three problems.

    python -m experiments.beyond.trust_ratio               # linear, mlp and lm
    python -m experiments.beyond.trust_ratio --problems linear,mlp --out experiments/beyond/results

The problems of docs/algorithms/onebit_lamb.md, 4 ranks each, every rank on its own shard:

- linear: OnebitAdam's linear regression (20 inputs, 150 steps, cosine lr 0.1), T_w = 30,
  default betas;
- mlp: the tanh MLP of tests/multirank/test_lamb_zero_one_gloo.py (750 steps, cosine lr 0.02,
  β2 = 0.98, T_w = 150);
- lm: the demo's byte LM (300 steps, T_w = 75, lr 1e-2 = 5·the demo's Adam lr).

LAMB is ``OnebitLamb`` that never leaves its warmup (fp32 averaging every step). Writes
results/trust_ratio_<problems>.md.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from commopt import OnebitLamb
from experiments.beyond.demo_lm import run_demo_variants
from tests.multirank.harness import run_ranks
from tests.multirank.test_lamb_zero_one_gloo import (
    LAMB_BATCH,
    LAMB_BETAS,
    LAMB_FREEZE_AT,
    LAMB_LR,
    LAMB_STEPS,
    STEPS,
    _fit_linear,
    _fit_mlp,
    minibatch_loss,
)

OUT = pathlib.Path(__file__).parent / "results"
LINEAR_LR, LINEAR_FREEZE = 0.1, 30
MODES = ("LAMB", "frozen", "tracking", "max")


def _small(backend, problem: str) -> dict[str, float]:
    n, rank = backend.world_size, backend.rank
    out = {}
    for mode in MODES:
        if problem == "linear":
            freeze = STEPS + 1 if mode == "LAMB" else LINEAR_FREEZE

            def make(params, freeze=freeze, mode=mode):
                ratio = "frozen" if mode == "LAMB" else mode
                return OnebitLamb(
                    params, lr=LINEAR_LR, freeze_step=freeze, trust_ratio=ratio, backend=backend
                )

            out[mode] = _fit_linear(make, minibatch_loss([rank], n))  # cosine lr 0.1
        else:
            freeze = LAMB_STEPS + 1 if mode == "LAMB" else LAMB_FREEZE_AT

            def make(params, freeze=freeze, mode=mode):
                ratio = "frozen" if mode == "LAMB" else mode
                return OnebitLamb(
                    params,
                    lr=LAMB_LR,
                    betas=LAMB_BETAS,
                    freeze_step=freeze,
                    trust_ratio=ratio,
                    backend=backend,
                )

            out[mode] = _fit_mlp(make, minibatch_loss([rank], n, LAMB_BATCH))
    return out


def _lm() -> dict[str, float]:
    def make(mode):
        def build(params, cfg):
            freeze = cfg.steps + 1 if mode == "LAMB" else cfg.warmup
            ratio = "frozen" if mode == "LAMB" else mode
            return OnebitLamb(params, lr=5 * cfg.lr, freeze_step=freeze, trust_ratio=ratio)

        return build

    res = run_demo_variants({mode: make(mode) for mode in MODES})
    return {mode: res[mode]["val_loss"] for mode in MODES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", default="linear,mlp,lm")
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    args = parser.parse_args(argv)
    rows = []
    for problem in [p.strip() for p in args.problems.split(",") if p.strip()]:
        if problem == "lm":
            losses = _lm()
        else:
            per_rank = run_ranks(_small, 4, problem, timeout=1800.0)
            assert all(r == per_rank[0] for r in per_rank), "replicas differ"
            losses = per_rank[0]
        lamb = losses["LAMB"]
        cells = [f"{losses[m]:.4f} ({losses[m] / lamb:.3f}×)" for m in MODES[1:]]
        rows.append(f"| {problem} | {lamb:.4f} | {' | '.join(cells)} |")
        print(rows[-1], flush=True)
    text = "\n".join(
        [
            "## 1-bit LAMB: frozen, tracking and max trust ratios (final loss; ratio to LAMB)",
            "",
            "| problem | LAMB | 1-bit LAMB frozen (SPEC §3) | tracking | max |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"trust_ratio_{'_'.join(args.problems.split(','))}.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
