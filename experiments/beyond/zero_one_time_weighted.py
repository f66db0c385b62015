r"""Measurement only: 0/1 Adam with a variance EMA in steps instead of in updates, on the demo LM.

    python -m experiments.beyond.zero_one_time_weighted --seeds 0,1 --out experiments/beyond/results

Not an option of ``commopt.ZeroOneAdam``: a subclass that weights each variance step by the
interval it stands for, v ← β2^I·v + (1 − β2^I)·ḡ², and corrects with the steps covered,
v̂ = v/(1 − β2^τ), τ = Σ I (m̂ as ``bias_correction=True``). It re-states ``_phase_a_step`` and
``_frozen_denominator`` of commopt/optim/zero_one_adam.py as of this commit (single-process
state only: τ is not saved). docs/algorithms/zero_one_adam.md ("Tried, not adopted") has the
figures. The demo's byte LM, 300 steps, 4 ranks, the §3 0/1 Adam schedule.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

from commopt.optim.adam_math import update_moments_
from commopt.optim.zero_one_adam import ZeroOneAdam
from experiments.beyond.demo_lm import SMALL, _ranks
from experiments.common import describe_machine, launch
from experiments.demo import train_bytelm as demo

OUT = pathlib.Path(__file__).parent / "results"


class TimeWeightedZeroOne(ZeroOneAdam):
    """v ← β2^I·v + (1 − β2^I)·ḡ² on a variance step of interval I; v̂ = v/(1 − β2^τ)."""

    def _phase_a_step(self, step: int) -> None:
        variance = self._is_variance_step(step)
        gs = self.global_state
        interval = gs["var_interval"]
        if variance:
            gs["tau"] = gs.get("tau", 0) + interval
        for state in self.flat_states:
            m, v = state.flat["exp_avg"], state.flat["exp_avg_sq"]
            if variance:
                g = self._averaged_grads(state)
            else:
                g = self._take_exchanged_gradient(state)
                if g is None:
                    g = state.gather_grads(state.scratch("grad"))
                    self._compress(state, g)
                self._mask(state, g)
            for seg, group in self.segments(state):
                beta1, beta2 = group["betas"]
                sl = seg.slice
                update_moments_(m[sl], v[sl] if variance else None, g[sl], beta1, beta2**interval)
            self._adam_update(state, variance)
        if variance:
            self._advance_variance()

    def _frozen_denominator(self, state, updated: bool = False):
        tau = self.global_state.get("tau", 0)
        bias = [
            math.sqrt(1 - g["betas"][1] ** tau) if tau else 1.0 for _, g in self.segments(state)
        ]
        return state.denominator(bias, self._eps(state))


def _make(beta2: float, freeze: int | None):
    def build(params, cfg):
        return TimeWeightedZeroOne(
            params,
            lr=cfg.lr,
            betas=(0.9, beta2),
            var_freeze_step=freeze or cfg.warmup,
            var_update_scaler=16,
            local_step_scaler=max(1, cfg.steps // 4),
            local_step_clipper=16,
            bias_correction=True,
        )

    return build


SETTINGS = [(0.999, None), (0.999, 100_000), (0.96, None)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--steps", type=int, default=demo.Config.steps)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--small", action="store_true", help="a tiny model and corpus (tests)")
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    args = parser.parse_args(argv)
    variants = [
        demo.Variant(
            f"time-weighted β2={b} T_v={f or 75}", _make(b, f), False, lambda c: c.warmup + 1, ""
        )
        for b, f in SETTINGS
    ]
    lines = [
        f"Machine: {describe_machine()}.",
        "",
        "| variant | seed | val loss |",
        "|---|---|---|",
    ]
    for seed in (int(s) for s in args.seeds.split(",")):
        extra = SMALL if args.small else {}
        cfg = demo.Config(steps=args.steps, seed=seed, **extra)
        out = launch(_ranks, args.ranks, variants, cfg, timeout=7200.0)
        lines += [f"| {v.label} | {seed} | {out[v.label]['val_loss']:.4f} |" for v in variants]
    text = "\n".join(["## 0/1 Adam, variance EMA in steps (measurement only)", "", *lines]) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "zero_one_time_weighted.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
