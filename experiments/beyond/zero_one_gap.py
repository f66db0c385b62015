r"""Measurement: where 0/1 Adam's gap to Adam comes from at its literal defaults, and what closes it

    python -m experiments.beyond.zero_one_gap --task lm --seeds 0,1 --out experiments/beyond/results
    python -m experiments.beyond.zero_one_gap --task digits --seeds 0,1,2
    python -m experiments.beyond.zero_one_gap --task demo --seeds 0,1

At ``var_freeze_step=100000`` a run of a few hundred steps never leaves phase A: variance steps
that thin out (I_v doubles after every ``var_update_scaler`` of them) average the gradient at fp32,
every other step averages it at one bit. The variants split the gap to ``torch.optim.Adam``
(same lr, betas (0.9, 0.999)) into those two parts and try what might close it:

- ``ZeroOneAdam``: the defaults (``var_update_scaler=16``, ``bias_correction=True``);
- ``fp32 between variance steps``: a subclass that averages the gradient at fp32 on the steps
  that would be 1-bit (v still thinned): what the thinned variance alone costs;
- ``momentum at one bit``: a subclass whose 1-bit steps average the local momentum
  β1·m + (1−β1)·g, as 1-bit Adam's compression stage does, instead of the gradient;
- ``preconditioned 1-bit gradient``: a subclass that exchanges g/(√v̂ + ε) and multiplies the
  result back, so the 1-bit code's magnitudes follow each element's √v̂;
- ``var_update_scaler=S``: more full-precision variance steps before I_v doubles;
- ``bucket_numel=B``: smaller buckets, so each 1-bit exchange has a scale per B elements
  instead of one for the whole model.

The subclasses re-state ``ZeroOneAdam._phase_a_step`` as of this commit (single-process state;
not options of the optimizer). 4 ranks; ``--task lm|digits`` are the convergence suite's tasks
and settings (experiments/convergence/run.py ``DEFAULTS``), ``--task demo`` the demo's byte LM.
Writes ``zero_one_gap_<task>.md`` into ``--out``; docs/algorithms/zero_one_adam.md has the
figures.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

from commopt.optim.adam_math import momentum_from_grads_
from commopt.optim.zero_one_adam import ZeroOneAdam
from experiments.beyond.common import run_variants
from experiments.beyond.demo_lm import ADAM, SMALL, run_seeds, seed_table
from experiments.common import describe_machine
from experiments.convergence.run import DEFAULTS
from experiments.demo import train_bytelm as demo

OUT = pathlib.Path(__file__).parent / "results"


class ExactBetweenVarianceSteps(ZeroOneAdam):
    """Phase A's 1-bit steps average the gradient at fp32 instead (v is thinned as before)."""

    def _compress(self, state, flat, comm=None):  # type: ignore[no-untyped-def]
        out = self._average(flat)
        if out is not flat:
            flat.copy_(out)
        return flat


class MomentumAtOneBit(ZeroOneAdam):
    """Phase A's 1-bit steps average m' = β1·m + (1−β1)·g_local at one bit: m ← C(m') ⊙ mask."""

    def _phase_a_step(self, step: int) -> None:
        if self._is_variance_step(step):
            super()._phase_a_step(step)
            return
        for state in self.flat_states:
            m = state.flat["exp_avg"]
            for seg, group in self.segments(state):
                momentum_from_grads_(seg.views(m), seg.params, group["betas"][0])
            self._compress(state, m)
            self._mask(state, m)
            self._adam_update(state, False)


class PreconditionedOneBit(ZeroOneAdam):
    """Phase A's 1-bit steps exchange u = g/(√v̂ + ε) (0 where v = 0) and use C(u)⊙(√v̂ + ε):
    the same bits (sgn u = sgn g), but each element's reconstructed magnitude follows its
    √v̂ instead of one scale for the whole bucket; v̂ is identical on every rank, so no extra
    message. The error buffers hold u-space residuals."""

    def _phase_a_step(self, step: int) -> None:
        if self._is_variance_step(step):
            super()._phase_a_step(step)
            return
        for state in self.flat_states:
            m, v = state.flat["exp_avg"], state.flat["exp_avg_sq"]
            d = self._frozen_denominator(state)
            g = state.gather_grads(state.scratch("grad"))
            g.div_(d).masked_fill_(v == 0, 0.0)
            self._compress(state, g)
            g.mul_(d)
            self._mask(state, g)
            for seg, group in self.segments(state):
                m[seg.slice].lerp_(g[seg.slice], 1 - group["betas"][0])
            self._adam_update(state, False)


def _zero_one(cls: type[ZeroOneAdam] = ZeroOneAdam, **kw: Any) -> Callable[..., Any]:
    def build(params: Any, lr: float, backend: Any = None) -> ZeroOneAdam:
        return cls(params, lr=lr, backend=backend, **kw)

    return build


VARIANTS: dict[str, Callable[..., Any] | None] = {
    ADAM: None,
    "ZeroOneAdam": _zero_one(),
    "fp32 between variance steps": _zero_one(ExactBetweenVarianceSteps),
    "momentum at one bit": _zero_one(MomentumAtOneBit),
    "preconditioned 1-bit gradient": _zero_one(PreconditionedOneBit),
    "var_update_scaler=32": _zero_one(var_update_scaler=32),
    "var_update_scaler=64": _zero_one(var_update_scaler=64),
    "bucket_numel=16384": _zero_one(bucket_numel=16384),
    "bucket_numel=4096": _zero_one(bucket_numel=4096),
}


def _suite(
    task: str, labels: list[str], seeds: list[int], steps: int, ranks: int
) -> dict[int, dict[str, Any]]:
    d = DEFAULTS[task]
    makers = {}
    for label in labels:
        build = VARIANTS[label]
        if build is None:
            makers[label] = lambda p, be: torch.optim.Adam(p, lr=d["lr"])
        else:
            makers[label] = lambda p, be, build=build: build(p, d["lr"], be)
    per_seed = {}
    for seed in seeds:
        result = run_variants(task, makers, steps, d["eval_every"], ranks, {"seed": seed})
        per_seed[seed] = {
            label: {
                "val_loss": run["rows"][-1]["val_loss"],
                "bytes": run["rows"][-1]["bytes"],
                "skipped": 0,
                "identical": run["identical"],
            }
            for label, run in result["runs"].items()
        }
        print(seed, {k: round(v["val_loss"], 4) for k, v in per_seed[seed].items()}, flush=True)
    return per_seed


def _demo(
    labels: list[str], seeds: list[int], steps: int, ranks: int, small: bool
) -> dict[int, dict[str, Any]]:
    makers = {}
    for label in labels:
        build = VARIANTS[label]
        makers[label] = None if build is None else lambda p, c, build=build: build(p, c.lr)
    return run_seeds(makers, seeds, ranks, steps=steps, **(SMALL if small else {}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=("lm", "digits", "demo"), default="lm")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated labels")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--steps", type=int, default=None, help="default: the task's")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--small", action="store_true", help="demo: a tiny model (tests)")
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    args = parser.parse_args(argv)
    labels = [k for k in args.variants.split(",") if k]
    if ADAM not in labels:
        labels.insert(0, ADAM)
    seeds = [int(s) for s in args.seeds.split(",")]
    steps = args.steps or (
        demo.Config.steps if args.task == "demo" else DEFAULTS[args.task]["steps"]
    )
    if args.task == "demo":
        per_seed = _demo(labels, seeds, steps, args.ranks, args.small)
    else:
        per_seed = _suite(args.task, labels, seeds, steps, args.ranks)
    gaps = {
        label: statistics.fmean(
            per_seed[s][label]["val_loss"] / per_seed[s][ADAM]["val_loss"] - 1 for s in seeds
        )
        for label in labels
    }
    lines = [
        f"## 0/1 Adam's gap to Adam at its literal defaults, task {args.task}",
        "",
        f"Machine: {describe_machine()}. {steps} steps (all in phase A), {args.ranks} ranks, "
        f"seeds {args.seeds}, betas (0.9, 0.999), the task's lr for every row.",
        "",
        *seed_table(per_seed, labels, reference=ADAM),
        "",
        "Paired gap to Adam (mean over seeds of each seed's ratio − 1): "
        + ", ".join(f"{label} {100 * g:+.2f} %" for label, g in gaps.items() if label != ADAM)
        + ".",
    ]
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"zero_one_gap_{args.task}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
