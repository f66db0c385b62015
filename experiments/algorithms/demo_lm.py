r"""Run extra optimizer variants on the demo's byte-level LM (:mod:`experiments.harness.bytelm`).

The demo's model, corpus, batches, evaluation sets and training run, unchanged; only the list of
variants is ours. 4 forked gloo ranks (or the launcher's ranks under torchrun/mpirun).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

import torch

from commopt.comm import resolve_backend
from experiments.harness import bytelm, describe_machine, launch

__all__ = ["ADAM", "SMALL", "run_demo_variants", "run_seeds", "seed_table"]

#: ``--small``: a tiny model and corpus, for the smoke tests
SMALL = dict(batch=4, hidden=16, embed=8, eval_contexts=64, max_corpus_bytes=2_000_000)

#: the reference row of :func:`run_seeds`: torch.optim.Adam on fp32-averaged gradients
ADAM = "Adam"


def train_variants(variants: list[bytelm.Variant], cfg: bytelm.Config) -> dict[str, Any]:
    train_data, val_data, _, _ = bytelm.load_corpus(cfg.max_corpus_bytes)
    eval_sets = bytelm.fixed_eval_sets(train_data, val_data, cfg)
    out = {}
    backend = resolve_backend(None)  # the one the optimizers resolve too: its counter is theirs
    for variant in variants:
        backend.stats.reset()
        result = bytelm.train(variant, cfg, backend, train_data, eval_sets, lambda msg: None)
        out[variant.label] = {
            "val_loss": result.val_loss,
            "train_loss": result.train_loss,
            "bytes": sum(result.step_bytes),
            "skipped": result.skipped_steps,
            "identical": result.identical,
        }
    out["_machine"] = describe_machine()
    return out


def run_demo_variants(
    makers: dict[str, Callable[[Any, bytelm.Config], torch.optim.Optimizer]],
    cfg: bytelm.Config | None = None,
    world_size: int = 4,
) -> dict[str, Any]:
    """{label: {val_loss, train_loss, bytes, skipped, identical}} after the demo's training."""
    cfg = cfg or bytelm.Config()
    variants = [
        bytelm.Variant(label, make, False, lambda c: c.warmup + 1, label)
        for label, make in makers.items()
    ]
    return launch(train_variants, world_size, variants, cfg, timeout=7200.0)


def run_seeds(
    makers: dict[str, Callable[[Any, bytelm.Config], torch.optim.Optimizer] | None],
    seeds: list[int],
    world_size: int = 4,
    **config: Any,
) -> dict[int, dict[str, Any]]:
    """{seed: {label: {val_loss, …}}}: every maker trained on the demo with ``bytelm.Config(seed,
    **config)``; a maker of None is the reference, ``torch.optim.Adam(lr=cfg.lr)`` on gradients
    averaged at fp32 by the training loop. Prints each seed's results as it finishes."""
    per_seed = {}
    for seed in seeds:
        variants = [
            bytelm.Variant(label, lambda p, c: torch.optim.Adam(p, lr=c.lr), True, None, label)
            if make is None
            else bytelm.Variant(label, make, False, lambda c: c.warmup + 1, label)
            for label, make in makers.items()
        ]
        cfg = bytelm.Config(seed=seed, **config)
        per_seed[seed] = launch(train_variants, world_size, variants, cfg, timeout=7200.0)
        print(seed, {k: v for k, v in per_seed[seed].items() if k != "_machine"}, flush=True)
    return per_seed


def _loss(x: float) -> str:
    return f"{x:.4f}" if math.isfinite(x) else "diverged (NaN)"


def seed_table(
    per_seed: dict[int, dict[str, Any]], labels: list[str], reference: str | None = None
) -> list[str]:
    """Markdown rows, one per label: the final validation loss per seed, the mean (NaN if a seed
    diverged), its gap to ``reference``'s mean if given, skipped steps, MB sent per rank and
    whether the replicas were bit-identical on every seed."""
    seeds = list(per_seed)
    means = {}
    for label in labels:
        losses = [per_seed[s][label]["val_loss"] for s in seeds]
        means[label] = statistics.fmean(losses) if all(map(math.isfinite, losses)) else math.nan
    gap = reference is not None
    lines = [
        "| variant | "
        + " | ".join(f"val loss seed {s}" for s in seeds)
        + " | mean"
        + (f" | vs {reference}" if gap else "")
        + " | steps skipped (non-finite) | MB sent/rank | replicas identical |",
        "|---|" + "---|" * len(seeds) + "---|" + ("---|" if gap else "") + "---|---|---|",
    ]
    ref = means.get(reference, math.nan) if gap else math.nan
    for label in labels:
        rows = [per_seed[s][label] for s in seeds]
        cells = [_loss(r["val_loss"]) for r in rows] + [_loss(means[label])]
        if gap:
            cells.append(f"{(means[label] / ref - 1) * 100:+.1f} %")
        cells += [
            str(sum(r["skipped"] for r in rows)),
            f"{rows[0]['bytes'] / 1e6:.2f}",
            "yes" if all(r["identical"] for r in rows) else "no",
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines
