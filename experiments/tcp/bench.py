r"""Benchmark (not a test): steady-state step time of each variant on a communication-bound model.

All variants run in ONE process group, one after the other, so they share the same links and
the same machine state; ratios are against ``DDP-fp32`` and ``DDP-fp16`` of the same run.

Model: a wide MLP, ``Linear(width, hidden) → GELU → (Linear(hidden, hidden) → GELU) × depth →
Linear(hidden, width)`` (default 1024 → 4096 → 4096 → 1024: 25.2M parameters), trained on a
regression to a fixed random target with ``batch`` rows per rank (default 4), so there are few
FLOPs per parameter and every step is dominated by moving the gradient (DDP) or momentum.

``--model transformer``: a small pre-norm transformer encoder over token ids (default 4 layers,
d_model 512, 8 heads, feed-forward 2048, vocabulary 8192, ``batch`` sequences of ``seq`` tokens:
16.8M parameters), cross-entropy on random targets. It does 6·tokens FLOPs per parameter per
step like any dense model, but with ``seq`` × ``batch`` tokens instead of ``batch`` rows, so
backward takes long enough for ``overlap=True`` to have something to hide behind.

``--bucket-numel`` sets the bucket size of every commopt variant (an optimizer with overlap off
and on gets the same, so their results are bit-identical to each other); several buckets are
what lets an overlapped exchange start before backward ends.

What the commopt variants time (``X-overlap`` is X with ``overlap=True``):

- ``OnebitAdam``, ``OnebitLamb`` (and ``-overlap``): the compression stage (after the freeze
  step ``warmup``).
- ``ZeroOneAdam`` (and ``-overlap``): phase B with the local interval doubling every step up to
  ``local_step_clipper``: mostly local steps, which send nothing (a mean, so the rare sync steps
  are included in proportion; overlap has only those to hide).
- ``ZeroOneAdam-1bitA`` (and ``-overlap``): phase A (the variance is never frozen) with
  ``var_update_scaler=1``: steps 1, 2, 4, 8, 16, ... are variance steps (fp32 averages), every
  other step a 1-bit gradient step. With ``--warmup 2 --settle 6 --measure 7`` the timed steps
  are 9–15, all 1-bit; the table's "fp32 / 1-bit rounds" column shows what a window held.
- ``ZeroOneAdam-syncB`` (and ``-overlap``): phase B with the local interval held at 1, so every
  timed step is a sync step (local update, then the 1-bit exchange of the parameter change).

- ``Local``: Adam on each rank's own gradients, no communication at all: the floor under any
  method that communicates.
- ``DiLoCo-…`` (any label of :func:`experiments.harness.is_variant`, e.g.
  ``DiLoCo-onebit-H50``, ``DiLoCo-onebit-H50-P4-d4``): inner steps with the syncs amortized.
  ``Local`` and the DiLoCo rows time ``--diloco-measure`` steps (default 100, a multiple of
  every H timed), so each fragment syncs the same number of times in every window; the
  table's ``sync ms`` column is the slowest rank's time in the steps that synced minus its
  median local step, i.e. the communication the inner steps did not hide.

Checks, per variant after its timed steps: ``replicas_identical`` (a sha256 of the parameters,
compared over all ranks; ``ZeroOneAdam``'s replicas legitimately differ between syncs) and, for
every ``X-overlap`` run together with X, ``same_as_off`` (X-overlap's parameters hash to X's:
the overlap path must give the same bits). ``skipped_steps`` must be 0.

Per variant: ``warmup`` + ``settle`` untimed steps (to enter the compression stage / phase B
with the local interval at ``local_step_clipper``, and PowerSGD's compressed stage), then
``measure`` timed steps between two barriers; the figure is the slowest rank's wall time / steps
(a mean, so ZeroOneAdam's rare sync steps are included in proportion). ``measure`` should be a
multiple of ``local_step_clipper``.

Run on emulated hosts (as root; ``experiments/tcp/run.sh`` brings netlab up and down)::

    bash experiments/tcp/run.sh 1gbit
    bash experiments/tcp/run.sh 100mbit --measure 16

or locally on forked ranks: ``python -m experiments.tcp.bench --world-size 4``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import hashlib
import json
import math
import pathlib
import statistics
import sys
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from experiments.harness import Hyper, describe_machine, is_variant, launch, make_setup

__all__ = ["TCP_VARIANTS", "SmallTransformer", "WideMLP", "main", "measure"]

TCP_VARIANTS = (
    "DDP-fp32",
    "DDP-fp16",
    "DDP-PowerSGD",
    "OnebitAdam",
    "ZeroOneAdam",
    "OnebitLamb",
    "OnebitAdam-overlap",
    "DDP-OnebitAdam",
    "DDP-OnebitAdam-late",
    "OnebitLamb-overlap",
    "ZeroOneAdam-overlap",
    "ZeroOneAdam-1bitA",
    "ZeroOneAdam-1bitA-overlap",
    "ZeroOneAdam-syncB",
    "ZeroOneAdam-syncB-overlap",
    "Local",
    "DiLoCo-onebit-H50",
    "DiLoCo-onebit-H50-P4-d4",
)


class WideMLP(nn.Module):
    """Wide GELU MLP: many parameters, little compute per parameter at small batch."""

    def __init__(self, width: int, hidden: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(width, hidden), nn.GELU()]
        for _ in range(depth):
            layers += [nn.Linear(hidden, hidden), nn.GELU()]
        layers.append(nn.Linear(hidden, width))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallTransformer(nn.Module):
    """Token embedding, pre-norm transformer encoder layers, a linear head over the vocabulary."""

    def __init__(self, vocab: int, d_model: int, heads: int, ff: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d_model, heads, ff, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def _model_and_data(
    args: argparse.Namespace, rank: int
) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Any]:
    """The model (seeded alike on every rank), this rank's fixed batch, and the loss."""
    gen = torch.Generator().manual_seed(1234 + rank)
    torch.manual_seed(0)
    if args.model == "transformer":
        model = SmallTransformer(args.vocab, args.d_model, args.heads, args.ff, args.layers)
        x = torch.randint(args.vocab, (args.batch, args.seq), generator=gen)
        y = torch.randint(args.vocab, (args.batch, args.seq), generator=gen)

        def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

        return model, x, y, loss_fn
    model = WideMLP(args.width, args.hidden, args.depth)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randn(args.batch, args.width, generator=gen)
    return model, x, y, F.mse_loss


def _digest(model: nn.Module) -> tuple[str, bool]:
    """sha256 of this rank's parameters (rank 0's, hex) and whether every rank has the same."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    word = torch.tensor([int.from_bytes(h.digest()[:8], "little", signed=True)])
    words = [torch.zeros_like(word) for _ in range(dist.get_world_size())]
    dist.all_gather(words, word)
    return h.hexdigest()[:16], all(int(w) == int(word) for w in words)


def _rss_mb() -> float:
    """This process's resident set size in MB (Linux /proc), NaN elsewhere, after glibc has
    returned the free heap it keeps (``malloc_trim``): what is left is memory still in use."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/status") as f:
            kb = next(line for line in f if line.startswith("VmRSS:")).split()[1]
    except (OSError, StopIteration):
        return math.nan
    return int(kb) / 1024


def _rounds(optimizer: Any) -> tuple[int, int] | None:
    """(full-precision, compressed) rounds so far of a commopt optimizer, else None."""
    s = optimizer.comm_stats() if hasattr(optimizer, "comm_stats") else {}
    if "full_precision_rounds" not in s:
        return None
    return s["full_precision_rounds"], s["compressed_rounds"]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run on every rank: each variant's mean step time and traffic (rank 0's dict)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    hp = Hyper(
        # Tiny steps: timing only. With larger ones 0/1 Adam, whose variance is frozen after
        # `warmup` steps without bias correction, blew up and then skipped its steps.
        lr=1e-6,
        lamb_lr=1e-6,
        warmup=args.warmup,
        steps=args.warmup + args.settle + args.measure,
        powersgd_rank=args.powersgd_rank,
        local_step_scaler=1,  # phase B: the local interval doubles every step up to the clipper
        local_step_clipper=args.local_step_clipper,
        bucket_numel=args.bucket_numel,
    )
    results: dict[str, Any] = {"variants": {}}
    for label in args.variants:
        local = label == "Local" or label.startswith("DiLoCo")
        steps = args.diloco_measure if local else args.measure
        model, x, y, loss_fn = _model_and_data(args, rank)
        results["numel"] = sum(p.numel() for p in model.parameters())
        setup = make_setup(label, model, hp)
        for _ in range(args.warmup + args.settle):
            setup.step(loss_fn(setup.model(x), y))
        dist.barrier()
        b0, c0 = setup.bytes_sent, setup.collectives
        seconds0 = dict(setup.seconds)
        # (read through setup: a local name for the optimizer would keep it alive past the
        # freed-check below, as one did on 2026-11-26: RSS 784 → 1271 MB over three variants)
        overlapped = getattr(setup.optimizer, "overlap", False)
        thread = setup.optimizer.early_work.thread if overlapped else None
        busy0 = thread.busy_seconds if thread is not None else 0.0
        rounds0 = _rounds(setup.optimizer)
        step_s, forward_s = [], 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            ts = time.perf_counter()
            loss = loss_fn(setup.model(x), y)
            forward_s += time.perf_counter() - ts
            setup.step(loss)
            step_s.append(time.perf_counter() - ts)
        dist.barrier()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        setup.close()
        sent, calls = setup.bytes_sent - b0, setup.collectives - c0  # the timed steps' only
        if hasattr(setup.optimizer, "finish"):  # DiLoCo: one model again, outside the timing
            setup.optimizer.finish()
        rounds1 = _rounds(setup.optimizer)
        digest, identical = _digest(model)
        skipped = 0
        if hasattr(setup.optimizer, "comm_stats"):
            skipped = setup.optimizer.comm_stats().get("skipped_steps", 0)
        median = statistics.median(step_s)
        entry = {
            "skipped_steps": skipped,
            "timed_steps": steps,
            "mean_ms": 1e3 * float(elapsed) / steps,
            "median_ms": 1e3 * median,
            "max_ms": 1e3 * max(step_s),
            # rank 0's time above its median step, per step: a DiLoCo sync's exposed share
            "above_median_ms": 1e3 * (sum(step_s) - steps * median) / steps,
            "bytes_per_step": sent / steps,
            "collectives_per_step": calls / steps,
            "stage": setup.stage(hp.steps, hp),
            # what the timed window held (commopt variants; DDP: 0, 0)
            "timed_fp32_rounds": None if rounds1 is None else rounds1[0] - rounds0[0],
            "timed_1bit_rounds": None if rounds1 is None else rounds1[1] - rounds0[1],
            "param_digest": digest,
            "replicas_identical": identical,
            # where a step's time goes, on rank 0: forward, backward (DDP: with its
            # all-reduce; overlap: with the folds), step() (overlap: the wait for the thread),
            # and the communication thread's busy time
            "forward_ms": 1e3 * forward_s / steps,
            "backward_ms": 1e3 * (setup.seconds["backward"] - seconds0["backward"]) / steps,
            "optimizer_step_ms": 1e3 * (setup.seconds["step"] - seconds0["step"]) / steps,
            "thread_busy_ms": (
                1e3 * (thread.busy_seconds - busy0) / steps if thread is not None else None
            ),
        }
        off = results["variants"].get(label.removesuffix("-overlap"))
        if label.endswith("-overlap") and off is not None:
            entry["same_as_off"] = digest == off["param_digest"]
        results["variants"][label] = entry
        if rank == 0 and args.progress:
            print(
                f"  {label:<13} {entry['mean_ms']:9.1f} ms/step (median {entry['median_ms']:.1f})"
                f"  {entry['bytes_per_step'] / 1e6:8.2f} MB/step/rank [{entry['stage']}]"
                f" replicas identical {identical}"
                + (f", same as off {entry['same_as_off']}" if "same_as_off" in entry else ""),
                flush=True,
            )
        # Every variant runs in this one process: what one leaves behind, the next pays for
        # (an overlap optimizer's thread and staged buffers once grew RSS by 6 GB per rank).
        freed = weakref.ref(setup.optimizer)
        del setup, model
        gc.collect()
        entry["optimizer_freed"] = freed() is None
        entry["rss_mb_after"] = _rss_mb()
        if rank == 0 and args.progress:
            print(
                f"  {'':<13} after it: RSS {entry['rss_mb_after']:.0f} MB, optimizer freed "
                f"{entry['optimizer_freed']}",
                flush=True,
            )
    results["world_size"] = n
    return results


def _rounds_text(e: dict[str, Any]) -> str:
    if e.get("timed_fp32_rounds") is None:
        return "-"
    return f"{e['timed_fp32_rounds']} / {e['timed_1bit_rounds']}"


def _yes_no(flag: bool | None) -> str:
    return "-" if flag is None else ("yes" if flag else "**NO**")


def report(results: dict[str, Any], args: argparse.Namespace, machine: str) -> str:
    v = results["variants"]
    fp32 = v.get("DDP-fp32", {}).get("mean_ms")
    fp16 = v.get("DDP-fp16", {}).get("mean_ms")
    floor = v.get("Local", {}).get("mean_ms")
    if args.model == "transformer":
        model = (
            f"SmallTransformer {args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
            f"ff {args.ff}, vocab {args.vocab}, {results['numel']:,} parameters, batch "
            f"{args.batch}×{args.seq} tokens/rank"
        )
    else:
        model = (
            f"WideMLP {args.width}→{args.hidden}(×{args.depth + 1})→{args.width}, "
            f"{results['numel']:,} parameters, batch {args.batch}/rank"
        )
    bucket = f"; commopt bucket_numel {args.bucket_numel}" if args.bucket_numel else ""
    lines = [
        f"{args.label}: {results['world_size']} ranks, {model}{bucket}; warmup {args.warmup} + "
        f"{args.settle} untimed steps, "
        f"{args.measure} timed steps ({args.diloco_measure} for Local and DiLoCo); PowerSGD "
        f"rank {args.powersgd_rank}; ZeroOneAdam local "
        f"interval {args.local_step_clipper}.",
        f"Machine: {machine}.",
        "",
        "| variant | stage timed | mean ms/step | median ms/step | speed-up vs DDP-fp32 "
        "| speed-up vs DDP-fp16 | / Local | above median ms/step | MB sent/step/rank "
        "| collectives/step "
        "| forward / backward / step() ms (rank 0) | comm thread busy ms "
        "| timed fp32 / 1-bit rounds | replicas identical | overlap = off bits |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, e in v.items():
        r32 = f"{fp32 / e['mean_ms']:.2f}x" if fp32 else "-"
        r16 = f"{fp16 / e['mean_ms']:.2f}x" if fp16 else "-"
        rl = f"{e['mean_ms'] / floor:.2f}x" if floor else "-"
        if label == "DDP-fp32":  # torch's C++ reducer: not observable, so the ring model
            n = results["world_size"]
            mb = f"{2 * (n - 1) / n * 4 * results['numel'] / 1e6:.2f} (model)"
        else:
            mb = f"{e['bytes_per_step'] / 1e6:.2f}"
        busy = e.get("thread_busy_ms")
        lines.append(
            f"| {label} | {e['stage']} | {e['mean_ms']:.1f} | {e['median_ms']:.1f} | {r32} "
            f"| {r16} | {rl} | {e['above_median_ms']:.1f} | {mb} "
            f"| {e['collectives_per_step']:.2f} "
            f"| {e['forward_ms']:.0f} / {e['backward_ms']:.0f} / {e['optimizer_step_ms']:.0f} "
            f"| {'-' if busy is None else f'{busy:.0f}'} "
            f"| {_rounds_text(e)} "
            f"| {_yes_no(e.get('replicas_identical'))} | {_yes_no(e.get('same_as_off'))} |"
        )
    rss = [e["rss_mb_after"] for e in v.values()]
    freed = [label for label, e in v.items() if not e["optimizer_freed"]]
    lines += [
        "",
        f"Rank 0's RSS after each variant (all in one process): {rss[0]:.0f} MB after the first, "
        f"{max(rss):.0f} MB at most, {rss[-1]:.0f} MB after the last; optimizers not freed: "
        f"{', '.join(freed) or 'none'}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4, help="forked ranks (no launcher)")
    parser.add_argument("--variants", default=",".join(TCP_VARIANTS))
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=1, help="hidden×hidden layers")
    parser.add_argument("--batch", type=int, default=4, help="rows (mlp) or sequences")
    parser.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    parser.add_argument("--seq", type=int, default=16, help="transformer: tokens per sequence")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ff", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--bucket-numel", type=int, default=None, help="commopt buckets")
    parser.add_argument("--warmup", type=int, default=3, help="freeze step of the compressed")
    parser.add_argument("--settle", type=int, default=6, help="untimed steps after warmup")
    parser.add_argument("--measure", type=int, default=16)
    parser.add_argument(
        "--diloco-measure", type=int, default=100, help="timed steps of Local and DiLoCo rows"
    )
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument("--local-step-clipper", type=int, default=16)
    parser.add_argument("--label", default="forked ranks on one machine (no shaping)")
    parser.add_argument("--json", type=pathlib.Path, help="also write the raw figures here")
    parser.add_argument("--out", type=pathlib.Path, help="write the markdown table here")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--quiet", dest="progress", action="store_false")
    args = parser.parse_args(argv)
    args.variants = [s.strip() for s in args.variants.split(",") if s.strip()]
    unknown = sorted(v for v in args.variants if v not in TCP_VARIANTS and not is_variant(v))
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {list(TCP_VARIANTS)}")
    machine = describe_machine()
    results = launch(measure, args.world_size, args, timeout=args.timeout)
    if results is None:
        return 0
    table = report(results, args, machine)
    print(table, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args), **results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
