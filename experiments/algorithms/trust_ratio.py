r"""1-bit LAMB with frozen (SPEC §3), tracking and max trust ratios, and LAMB, on three problems.

    python -m experiments.algorithms.trust_ratio               # linear, mlp and lm
    python -m experiments.algorithms.trust_ratio --problems linear,mlp \
        --out experiments/algorithms/results
    python -m experiments.algorithms.trust_ratio --problems linear --seed 1   # another seed

The problems of docs/algorithms/onebit_lamb.md, 4 ranks each, every rank on its own shard:

- linear: OnebitAdam's linear regression (20 inputs, 150 steps, cosine lr 0.1), T_w = 30,
  default betas;
- mlp: the tanh MLP of tests/multirank/test_lamb_zero_one_gloo.py (750 steps, cosine lr 0.02,
  β2 = 0.98, T_w = 150);
- lm: the demo's byte LM (300 steps, T_w = 75, lr 1e-2 = 5·the demo's Adam lr).

LAMB is ``OnebitLamb`` that never leaves its warmup (fp32 averaging every step). ``--seed s``
(s > 0) re-seeds the minibatch streams (7 + rank + 1000·s), the linear model's initialisation
(1 + s) and the demo's ``Config.seed``. Writes results/trust_ratio_<problems>[_seed<s>].md.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

from commopt import OnebitLamb
from experiments.algorithms.demo_lm import run_demo_variants
from experiments.harness import run_ranks
from experiments.harness.bytelm import Config
from experiments.harness.small_tasks import (
    ADAM_LR,
    DIM,
    LAMB_BATCH,
    LAMB_BETAS,
    LAMB_FREEZE_AT,
    LAMB_LR,
    LAMB_STEPS,
    STEPS,
    fit,
    fit_linear,
    fit_mlp,
    minibatch_loss,
    regression_data,
)

OUT = pathlib.Path(__file__).parent / "results"
LINEAR_LR, LINEAR_FREEZE = 0.1, 30
MODES = ("LAMB", "frozen", "tracking", "max")


def _seeded_loss(rank: int, n: int, batch: int, seed: int):
    """minibatch_loss([rank], n, batch) with the stream seeded 7 + rank + 1000·seed."""
    if seed == 0:
        return minibatch_loss([rank], n, batch)
    stream = torch.Generator().manual_seed(7 + rank + 1000 * seed)

    def loss(model, x, y):
        xs, ys = x[rank::n], y[rank::n]
        idx = torch.randint(0, xs.shape[0], (batch,), generator=stream)
        return ((model(xs[idx]) - ys[idx]) ** 2).mean()

    return loss


def _small(backend, problem: str, seed: int = 0) -> dict[str, float]:
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

            if seed == 0:
                out[mode] = fit_linear(make, minibatch_loss([rank], n))  # cosine lr 0.1
            else:
                torch.manual_seed(1 + seed)
                model = torch.nn.Linear(DIM, 1)
                loss = _seeded_loss(rank, n, 16, seed)
                out[mode] = fit(make, model, regression_data(), STEPS, ADAM_LR, loss)
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

            out[mode] = fit_mlp(make, _seeded_loss(rank, n, LAMB_BATCH, seed))
    return out


def _lm(seed: int = 0) -> dict[str, float]:
    def make(mode):
        def build(params, cfg):
            freeze = cfg.steps + 1 if mode == "LAMB" else cfg.warmup
            ratio = "frozen" if mode == "LAMB" else mode
            return OnebitLamb(params, lr=5 * cfg.lr, freeze_step=freeze, trust_ratio=ratio)

        return build

    cfg = Config(seed=seed) if seed else None
    res = run_demo_variants({mode: make(mode) for mode in MODES}, cfg)
    return {mode: res[mode]["val_loss"] for mode in MODES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", default="linear,mlp,lm")
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = []
    for problem in [p.strip() for p in args.problems.split(",") if p.strip()]:
        if problem == "lm":
            losses = _lm(args.seed)
        else:
            per_rank = run_ranks(_small, 4, problem, args.seed, timeout=1800.0)
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
    name = "_".join(args.problems.split(",")) + (f"_seed{args.seed}" if args.seed else "")
    (args.out / f"trust_ratio_{name}.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
