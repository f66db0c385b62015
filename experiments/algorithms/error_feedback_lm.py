r"""EControl against classic error feedback on the demo's byte LM (every rank the same data mix).

    python -m experiments.algorithms.error_feedback_lm --seeds 0 \
        --out experiments/algorithms/results

The counterpart of ``experiments.algorithms.error_feedback`` (heterogeneous digits, where
EControl helps) on homogeneous data: the demo's byte LM (experiments/demo/train_bytelm.py, 300
steps, lr 2e-3, 4 ranks), OnebitAdam with the demo's ``freeze_step`` and
``error_feedback="classic"`` or ``"econtrol"`` at several η, and ``torch.optim.Adam`` as the
reference. Writes ``error_feedback_lm.md`` into ``--out``; docs/algorithms/error_feedback.md
has the figures.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import commopt
from experiments.algorithms.demo_lm import ADAM, SMALL, run_seeds, seed_table
from experiments.harness import bytelm, describe_machine

OUT = pathlib.Path(__file__).parent / "results"
ETAS = (0.0, 0.01, 0.05, 0.2, 0.5, 1.0)


def _onebit(**kw: Any) -> Callable[..., Any]:
    def build(params: Any, cfg: bytelm.Config) -> commopt.OnebitAdam:
        return commopt.OnebitAdam(params, lr=cfg.lr, freeze_step=cfg.warmup, **kw)

    return build


VARIANTS: dict[str, Callable[..., Any]] = {
    "OnebitAdam classic": _onebit(),
    **{
        f"OnebitAdam econtrol η={eta:g}": _onebit(error_feedback="econtrol", econtrol_eta=eta)
        for eta in ETAS
    },
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--steps", type=int, default=bytelm.Config.steps)
    parser.add_argument("--warmup", type=int, default=bytelm.Config.warmup, help="freeze_step")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--small", action="store_true", help="a tiny model and corpus (tests)")
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    labels = [ADAM, *VARIANTS]
    extra = SMALL if args.small else {}
    makers = {ADAM: None, **VARIANTS}
    per_seed = run_seeds(makers, seeds, args.ranks, steps=args.steps, warmup=args.warmup, **extra)
    lines = [
        "## EControl against classic error feedback on the demo byte LM",
        "",
        f"Machine: {describe_machine()}. {args.steps} steps, freeze_step "
        f"{args.warmup}, {args.ranks} ranks, seeds {args.seeds}.",
        "",
        *seed_table(per_seed, labels, reference=ADAM),
    ]
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "error_feedback_lm.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
