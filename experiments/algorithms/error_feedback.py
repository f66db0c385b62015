r"""EControl against classic error feedback when every rank holds different data.

    python -m experiments.algorithms.error_feedback            # digits, 4 ranks

Heterogeneous digits: rank r trains only on the classes c with c mod n == r (at n = 4: {0, 4,
8}, {1, 5, 9}, {2, 6}, {3, 7}); validation is the usual full, stratified set. In the
compression stage each rank's momentum is built from its own classes only, so the ranks'
buffers differ systematically; this is the regime where the EControl paper expects classic
error feedback to suffer. Variants: OnebitAdam and ZeroOneAdam (both with the convergence
suite's settings), each with error_feedback="classic" and "econtrol" at several η; ZeroOneAdam
also uncorrected (``bias_correction=False``, the papers' v) with "classic" and η = 0.2; and Adam
(fp32 averaging) as the reference. Writes results/error_feedback_digits.md and .png (with
``--seeds`` several: one pair per seed and error_feedback_digits_seeds.md).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

import commopt
from experiments.algorithms.common import plot_curves, run_variants, write_table
from experiments.harness import rank_and_size
from experiments.harness.tasks import DigitsTask

OUT = pathlib.Path(__file__).parent / "results"


class HeterogeneousDigits(DigitsTask):
    """DigitsTask whose rank r draws its batches from the classes c ≡ r (mod n) only."""

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rank, n = rank_and_size()
        mine = (self.y_train % n == rank).nonzero().flatten()
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + 7919 * step + rank)
        idx = mine[torch.randint(0, len(mine), (self.batch_per_rank,), generator=gen)]
        return self.x_train[idx], self.y_train[idx]

    def describe(self) -> str:
        return super().describe() + "; rank r trains on classes c ≡ r (mod n) only"


def makers(lr: float, beta2: float, warmup: int, steps: int, etas: list[float]) -> dict:
    def onebit(feedback, eta=0.2):
        return lambda params, be: commopt.OnebitAdam(
            params,
            lr=lr,
            betas=(0.9, beta2),
            freeze_step=warmup,
            backend=be,
            error_feedback=feedback,
            econtrol_eta=eta,
        )

    def zero_one(feedback, eta=0.2, bias_correction=True):
        return lambda params, be: commopt.ZeroOneAdam(
            params,
            lr=lr,
            betas=(0.9, beta2),
            var_freeze_step=warmup,
            local_step_scaler=max(1, steps // 4),
            backend=be,
            error_feedback=feedback,
            econtrol_eta=eta,
            bias_correction=bias_correction,
        )

    out = {"Adam": lambda params, be: torch.optim.Adam(params, lr=lr, betas=(0.9, beta2))}
    out["OnebitAdam classic"] = onebit("classic")
    for eta in etas:
        out[f"OnebitAdam econtrol η={eta}"] = onebit("econtrol", eta)
    out["ZeroOneAdam classic"] = zero_one("classic")
    for eta in etas:
        out[f"ZeroOneAdam econtrol η={eta}"] = zero_one("econtrol", eta)
    # the papers' uncorrected v (bias_correction=False, the default until 2026-11-22), beside
    out["ZeroOneAdam classic, uncorrected"] = zero_one("classic", bias_correction=False)
    out["ZeroOneAdam econtrol η=0.2, uncorrected"] = zero_one("econtrol", 0.2, False)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=60)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--beta2", type=float, default=0.99)
    parser.add_argument("--etas", default="0.05,0.2")
    parser.add_argument("--seeds", default="0", help="task seeds (model init and batches)")
    parser.add_argument("--only", default="", help="comma-separated subset of variant labels")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    etas = [float(e) for e in args.etas.split(",") if e.strip()]
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    chosen = makers(args.lr, args.beta2, args.warmup, args.steps, etas)
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    results = {}
    for seed in seeds:
        results[seed] = run_variants(
            "digits",
            chosen,
            args.steps,
            15,
            args.ranks,
            overrides={"seed": seed},
            task_factory=HeterogeneousDigits,
        )
        tag = "" if len(seeds) == 1 else f"_seed{seed}"
        note = (
            f"{args.steps} steps, freeze/var_freeze step {args.warmup}, lr {args.lr}, betas "
            f"(0.9, {args.beta2}), {args.ranks} ranks, each rank on its own classes; seed {seed}."
        )
        path = args.out / f"error_feedback_digits{tag}.md"
        print(write_table(results[seed], path, "EControl vs classic EF", note))
        plot_curves(
            results[seed], args.out / f"error_feedback_digits{tag}.png", "heterogeneous digits"
        )
    if len(seeds) > 1:
        lines = [
            "| variant | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |",
            "|---|" + "---|" * (len(seeds) + 1),
        ]
        for label in chosen:
            finals = [results[s]["runs"][label]["rows"][-1]["val_loss"] for s in seeds]
            cells = " | ".join(f"{v:.4f}" for v in finals)
            lines.append(f"| {label} | {cells} | {sum(finals) / len(finals):.4f} |")
        text = "## Final validation loss over seeds\n\n" + "\n".join(lines) + "\n"
        (args.out / "error_feedback_digits_seeds.md").write_text(text)
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
