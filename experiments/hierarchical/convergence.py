# ruff: noqa: E402  (torch is imported after its CPU kernels are capped, below)
r"""Experiment: does 1-bit Adam converge the same with the hierarchical exchange as with flat?

4 forked gloo ranks faking 2 nodes × 2 ranks (LOCAL_RANK / LOCAL_WORLD_SIZE / GROUP_RANK set per
rank), an MLP 32 → 256 → 256 → 10 on a fixed random teacher's labels, each rank with its own
data stream, ``OnebitAdam(lr=2e-3, freeze_step=50, topology=...)``, 400 steps of batch 64 per
rank. For each seed, both topologies see the same data; the figure is the loss of the final
model on a held-out set of 4096 examples. The spread over seeds is the run-to-run noise the
difference between topologies is compared with.

    python -m experiments.hierarchical.convergence [--seeds 3] [--steps 400]
"""

from __future__ import annotations

from experiments.cpu_isa import cap_at_avx2

cap_at_avx2()  # before torch loads: the losses reported move with an ulp (see there)

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import commopt
from experiments.harness import Setup, launch, sum_over_ranks, train_on_task

__all__ = ["main"]


class _TeacherTask:
    """A fixed random teacher's labels, argmax(tanh(x·T) + 0.1·noise) for x ~ N(0, I₃₂), as a
    harness task: each rank draws its own batches of 64; evaluation is the loss on a held-out
    set of 4096 examples, averaged over the ranks."""

    def __init__(self, seed: int, rank: int) -> None:
        self.teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(1000 + seed))
        self._gen = torch.Generator().manual_seed(100 * seed + rank)

    def data(self, gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, self.teacher.shape[0], generator=gen)
        noise = 0.1 * torch.randn(n, 10, generator=gen)
        return x, (torch.tanh(x @ self.teacher) + noise).argmax(1)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        del step  # (drawn in order)
        return self.data(self._gen, 64)

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> tuple[float, float]:
        x, y = self.data(torch.Generator().manual_seed(7), 4096)
        loss = sum_over_ranks([F.cross_entropy(model(x), y).item()])[0] / dist.get_world_size()
        return loss, loss


def _train(topology: str, seed: int, steps: int) -> float:
    rank = dist.get_rank()
    os.environ.update(LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2))
    task = _TeacherTask(seed, rank)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )  # fmt: skip
    opt = commopt.OnebitAdam(model.parameters(), lr=2e-3, freeze_step=50, topology=topology)
    final: list[float] = []

    def record(step: int, evaluation: tuple[float, float] | None, seconds: float) -> None:
        if evaluation is not None:
            final.append(evaluation[0])

    train_on_task(task, Setup(topology, model, opt, None, None, False), steps, steps, record)
    return final[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args(argv)
    results: dict[str, list[float]] = {"flat": [], "hierarchical": []}
    for seed in range(args.seeds):
        for topology in results:
            results[topology].append(launch(_train, 4, topology, seed, args.steps))
    print(f"held-out loss after {args.steps} steps, 2 nodes x 2 ranks (faked), OnebitAdam")
    print("| topology | " + " | ".join(f"seed {s}" for s in range(args.seeds)) + " | mean |")
    print("|---|" + "---|" * (args.seeds + 1))
    for topology, losses in results.items():
        cells = " | ".join(f"{v:.4f}" for v in losses)
        print(f"| {topology} | {cells} | {statistics.mean(losses):.4f} |")
    diffs = [h - f for f, h in zip(results["flat"], results["hierarchical"], strict=True)]
    spread = statistics.stdev(results["flat"]) if args.seeds > 1 else float("nan")
    print(
        f"hierarchical - flat per seed: {[round(d, 4) for d in diffs]}; spread of flat over "
        f"seeds (stdev): {spread:.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
