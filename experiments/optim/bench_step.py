r"""Time of one optimizer ``step()`` per rank, gradients already computed: commopt's 1-bit
optimizers in their compression stage next to ``torch.optim.Adam`` on gradients averaged by
one fp32 all_reduce, all in the same run.

What it isolates: the CPU work of the step (gradient gather, momentum, compression kernels,
update) and its collectives over the transport at hand, without forward and backward. Every
rank holds the same shapes as experiments/tcp's WideMLP (25,175,040 parameters by default)
and fixed random gradients of its own; each variant first runs past its warmup / variance
phase, then ``--steps`` timed calls between barriers. Reported: the median over rounds of rank
0's wall time per step, and per rank the process CPU time per step (robust to other jobs).

Forked gloo ranks over loopback by default (``--world-size``), or one process per rank under a
launcher (torchrun, mpirun, ``netlab run``, see experiments/tcp/run.sh for a shaped network).

Usage::

    python -m experiments.optim.bench_step [--world-size 4] [--width 4096] [--steps 5]
        [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import commopt
from experiments.harness import describe_machine, launch, rank_and_size

__all__ = ["main"]

VARIANTS = ("Adam+all_reduce", "OnebitAdam", "ZeroOneAdam", "OnebitLamb")


def _shapes(width: int, io: int) -> list[tuple[int, ...]]:
    """WideMLP io → width → width → io: weights and biases."""
    return [(width, io), (width,), (width, width), (width,), (io, width), (io,)]


def _optimizer(label: str, params: list[torch.nn.Parameter]) -> tuple[torch.optim.Optimizer, int]:
    """The optimizer and how many untimed steps bring it to its compression stage."""
    lr = 1e-6  # tiny: the parameters barely move, nothing diverges over many rounds
    if label == "Adam+all_reduce":
        return torch.optim.Adam(params, lr=lr), 1
    if label == "OnebitAdam":
        return commopt.OnebitAdam(params, lr=lr, freeze_step=1), 2
    if label == "OnebitLamb":
        return commopt.OnebitLamb(params, lr=lr, freeze_step=1), 2
    # variance frozen after step 1; local interval 16 from the 4th phase-B step on (1, 2, 4, 8, 16)
    return commopt.ZeroOneAdam(
        params, lr=lr, var_freeze_step=1, local_step_scaler=1, local_step_clipper=16
    ), 6


def _run(label: str, shapes: list[tuple[int, ...]], steps: int, rounds: int) -> dict:
    rank, n = rank_and_size()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    gen = torch.Generator().manual_seed(1 + rank)
    grads = [torch.randn(s, generator=gen) for s in shapes]
    opt, warm = _optimizer(label, params)
    flat = torch.empty(sum(g.numel() for g in grads)) if label == "Adam+all_reduce" else None

    def step() -> None:
        for p, g in zip(params, grads, strict=True):
            p.grad = g  # the same gradient every step: the step itself is what is timed
        if flat is not None:  # plain data parallelism: one fp32 all_reduce of every gradient
            torch.cat([g.reshape(-1) for g in grads], out=flat)
            dist.all_reduce(flat)
            flat.div_(n)
            offset = 0
            for p in params:
                p.grad = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        opt.step()

    for _ in range(warm + 16):  # past the warmup, and 0/1 Adam's interval at 16
        step()
    wall, cpu = [], []
    for _ in range(rounds):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step()
        dist.barrier()
        wall.append((time.perf_counter() - t0) / steps * 1e3)
        cpu.append((time.process_time() - c0) / steps * 1e3)
    cpu_all = [0.0] * n
    cpu_all[rank] = statistics.median(cpu)
    t = torch.tensor(cpu_all, dtype=torch.float64)
    dist.all_reduce(t)
    return {"wall_ms": statistics.median(wall), "cpu_ms_per_rank": t.tolist()}


def _bench(labels: list[str], width: int, io: int, steps: int, rounds: int) -> dict:
    shapes = _shapes(width, io)
    return {label: _run(label, shapes, steps, rounds) for label in labels}


def _report(results: dict, numel: int, n: int, machine: str) -> str:
    base = results.get("Adam+all_reduce", {}).get("wall_ms")
    lines = [
        f"optimizer step, {n} ranks, {numel:,} parameters, gradients preset; {machine}",
        "",
        "| variant | wall ms/step (rank 0, median) | CPU ms/step per rank | speed-up vs Adam |",
        "|---|---|---|---|",
    ]
    for label, r in results.items():
        cpu = ", ".join(f"{c:.0f}" for c in r["cpu_ms_per_rank"])
        ratio = f"{base / r['wall_ms']:.2f}x" if base else "–"
        lines.append(f"| {label} | {r['wall_ms']:.1f} | {cpu} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--io", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    labels = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(labels) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    results = launch(_bench, args.world_size, labels, args.width, args.io, args.steps, args.rounds)
    if results is None:  # not rank 0 under a launcher
        return 0
    numel = sum(torch.Size(s).numel() for s in _shapes(args.width, args.io))
    n = len(next(iter(results.values()))["cpu_ms_per_rank"])
    machine = describe_machine()
    print(_report(results, numel, n, machine))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "numel": numel, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
