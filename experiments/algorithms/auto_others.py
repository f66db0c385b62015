r"""1-bit LAMB and 0/1 Adam with the automatic freeze on the convergence suite's LM task.

    python -m experiments.algorithms.auto_others --out experiments/algorithms/results

OnebitLamb(freeze_step="auto") with its default trust ratio ("max") and the paper's ("frozen"),
and ZeroOneAdam(var_freeze_step="auto", local_step_scaler=75) with its default bias correction
and without (the paper's); 300 steps, β2 = 0.99, the suite's
learning rates, 4 ranks. Writes auto_lm_others.md into ``--out``.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import commopt
from experiments.algorithms.common import run_variants, write_table
from experiments.convergence.run import DEFAULTS

OUT = pathlib.Path(__file__).parent / "results"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=DEFAULTS["lm"]["steps"])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    d = DEFAULTS["lm"]
    betas = (0.9, 0.99)
    makers = {
        "OnebitLamb auto": lambda p, be: commopt.OnebitLamb(
            p, lr=d["lamb_lr"], betas=betas, freeze_step="auto", backend=be
        ),
        "OnebitLamb auto frozen": lambda p, be: commopt.OnebitLamb(
            p, lr=d["lamb_lr"], betas=betas, freeze_step="auto", trust_ratio="frozen", backend=be
        ),
        "ZeroOneAdam auto": lambda p, be: commopt.ZeroOneAdam(
            p, lr=d["lr"], betas=betas, var_freeze_step="auto", local_step_scaler=75, backend=be
        ),
        "ZeroOneAdam auto, no bias correction": lambda p, be: commopt.ZeroOneAdam(
            p,
            lr=d["lr"],
            betas=betas,
            var_freeze_step="auto",
            local_step_scaler=75,
            bias_correction=False,
            backend=be,
        ),
    }
    result = run_variants("lm", makers, args.steps, d["eval_every"], args.ranks)
    note = (
        f"{args.steps} steps, betas (0.9, 0.99), the convergence suite's learning rates, "
        f"{args.ranks} ranks."
    )
    title = "LAMB and 0/1 Adam with the automatic freeze, LM"
    print(write_table(result, args.out / "auto_lm_others.md", title, note))
    return 0


if __name__ == "__main__":
    sys.exit(main())
