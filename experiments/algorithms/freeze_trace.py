r"""Traces behind the automatic freeze rule: how v moves, before and after a freeze.

    python -m experiments.algorithms.freeze_trace --task digits --seed 0 --out /tmp/trace

Variants (4 forked gloo ranks, the convergence suite's settings, β2 = 0.99):

- ``adam``: Adam on the averaged gradient (a reference written here: m, v, bias correction
  as in OnebitAdam's warmup), never frozen;
- ``adam vF=<F>``: the same with v (and its bias factor) frozen after step F but m still
  averaged at full precision: what freezing v alone costs, without 1-bit noise;
- ``1bit F=<F>``: OnebitAdam(freeze_step=F): v frozen *and* m averaged at one bit.

Every step records the rank-averaged training loss and a *shadow* v: the EMA (β2) of the
squared averaged gradient that Adam would hold, kept by this script whatever the optimizer
does (one extra all-reduce, outside every byte counter). From it: ℓ_t = Σ_k mean(√v̂_k), each
tensor's mean √v̂_k, and after a freeze ℓ_frozen/ℓ_t (how much larger the frozen v is than
today's); for ``adam`` also each tensor's mean m̂² / mean v̂ (the signal's share of the
gradient: it falls to the noise floor, ≈ 0.02–0.05, by step ~50 on digits, so it does not tell
digits' still-falling v from a settled one). ``1bit auto`` (or any ``1bit`` without ``F=``)
uses ``freeze_step="auto"``. Writes ``trace_<task>_seed<S>.json``; the replay of the freeze
rule on these traces is in docs/algorithms/auto_freeze.md.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from typing import Any

import torch
import torch.distributed as dist

import commopt
from commopt.comm import TorchBackend
from experiments.convergence.run import DEFAULTS
from experiments.harness import launch, sum_over_ranks
from experiments.harness.tasks import load_task


class FrozenVAdam:
    """Adam on the averaged gradient, v frozen after step ``freeze`` (None: never)."""

    def __init__(self, params, lr, betas, freeze, eps=1e-8):
        self.params = list(params)
        self.lr, self.betas, self.freeze, self.eps = lr, betas, freeze, eps
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = 0

    @torch.no_grad()
    def step(self, grads):
        self.t += 1
        b1, b2 = self.betas
        vt = self.t if self.freeze is None else min(self.t, self.freeze)
        for p, g, m, v in zip(self.params, grads, self.m, self.v, strict=True):
            m.mul_(b1).add_(g, alpha=1 - b1)
            if self.t == vt:
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v / (1 - b2**vt)).sqrt_().add_(self.eps)
            p.addcdiv_(m, denom, value=-self.lr / (1 - b1**self.t))


def _run(task_name: str, seed: int, variants: list[str], steps: int) -> dict[str, Any]:
    d = DEFAULTS[task_name]
    lr, betas = d["lr"], (0.9, 0.99)
    task = load_task(task_name, seed=seed)
    out: dict[str, Any] = {}
    for label in variants:
        model = task.build_model()
        backend = TorchBackend()
        commopt.broadcast_parameters(model, backend=backend)
        params = [p for p in model.parameters()]
        names = [n for n, _ in model.named_parameters()]
        kind, _, arg = label.partition(" ")
        freeze = int(arg.split("=")[1]) if "=" in arg else None
        if kind == "1bit":
            opt = commopt.OnebitAdam(
                params,
                lr=lr,
                betas=betas,
                freeze_step=freeze if freeze else "auto",
                backend=backend,
            )
        else:
            opt = FrozenVAdam(params, lr, betas, freeze)
        shadow = [torch.zeros_like(p, dtype=torch.float64) for p in params]
        frozen_level = None
        rows = []
        for step in range(1, steps + 1):
            for p in params:
                p.grad = None
            loss = task.loss(model, task.batch(step))
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params]).double()
            dist.all_reduce(flat)
            flat /= dist.get_world_size()
            grads, off = [], 0
            for p, s in zip(params, shadow, strict=True):
                g = flat[off : off + p.numel()].view_as(s)
                off += p.numel()
                s.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
                grads.append(g.float())
            bias = 1 - betas[1] ** step
            per = [float(s.div(bias).sqrt().mean()) for s in shadow]
            level = sum(per)
            if kind == "1bit":
                opt.step()
                fa = opt.frozen_after()
                f_now = None if math.isinf(fa) else int(fa)
            else:
                opt.step(grads)
                f_now = freeze
            if f_now is not None and step == f_now:
                frozen_level = level
            train = sum_over_ranks([float(loss.detach())])[0] / dist.get_world_size()
            row = dict(
                step=step,
                train=train,
                level=level,
                per=per,
                gnorm2=float(flat.square().sum()),
            )
            if kind == "adam":  # signal share of the gradient: mean m̂² / mean v̂, per tensor
                c1, c2 = 1 - betas[0] ** step, 1 - betas[1] ** step
                row["snr"] = [
                    float((m / c1).square().mean() / (v / c2).mean().clamp_min(1e-30))
                    for m, v in zip(opt.m, opt.v, strict=True)
                ]
            if frozen_level is not None and step > f_now:
                row["frozen_over_now"] = frozen_level / level
            if kind == "1bit" and step % 10 == 0:
                row["comp_err"] = opt.comm_stats().get("compression_error")
            if step % d["eval_every"] == 0 or step == steps:
                row["val"] = task.evaluate(model)[0]
            rows.append(row)
        out[label] = dict(rows=rows, freeze=f_now, names=names)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=["lm", "digits"], default="digits")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int)
    parser.add_argument(
        "--variants", default="adam,adam vF=55,adam vF=200,1bit F=55,1bit F=200,1bit auto"
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/trace"))
    args = parser.parse_args(argv)
    steps = args.steps or DEFAULTS[args.task]["steps"]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    result = launch(_run, 4, args.task, args.seed, variants, steps, timeout=7200.0)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"trace_{args.task}_seed{args.seed}.json"
    path.write_text(json.dumps(result))
    for label, r in result.items():
        vals = [row["val"] for row in r["rows"] if "val" in row]
        print(f"{label:>14}: freeze {r['freeze']}, final val {vals[-1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
