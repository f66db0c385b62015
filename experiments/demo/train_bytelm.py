# ruff: noqa: E402  (torch is imported after its CPU kernels are capped, below)
r"""Data-parallel byte-level language model: Adam, 1-bit Adam, 0/1 Adam, LAMB, 1-bit LAMB, DiLoCo.

Run it under a launcher, one process per rank (``scripts/demo.sh`` does this)::

    mpiexec -n 4 python experiments/demo/train_bytelm.py
    torchrun --nproc_per_node=4 experiments/demo/train_bytelm.py

The task (the corpus, the model, one training run over the harness's training loop) is
:mod:`experiments.harness.bytelm`; this script is the demo's rows and its table. Every row trains
the same model from the same initial weights on the same batches; bytes sent are the commopt
backend's modelled per-rank bytes over the training steps only.

Adding an optimizer is one entry in :data:`VARIANTS`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pathlib
import statistics
import sys
import sysconfig
import time
import warnings

if __package__ in (None, ""):  # run as a script (mpiexec python experiments/demo/train_bytelm.py)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

# The figures the demo writes are a pure function of the code, the settings *and* torch's CPU
# kernels (AVX2 and AVX-512 round differently by an ulp, and the 1-bit rows amplify an ulp into
# another trajectory: an AVX-512 machine moved OnebitAdam's validation loss from 2.1124 to
# 2.1137). Capped at AVX2 before torch loads them, the table reproduces on any x86-64 CPU with
# AVX2; set the variables yourself to choose otherwise (experiments/cpu_isa.py).
from experiments.cpu_isa import cap_at_avx2

cap_at_avx2()

import torch
import torch.distributed as dist

import commopt
from commopt.diloco import default_fp32_syncs
from commopt.kernels import get_kernels
from experiments.harness.bytelm import (
    DEMO_TABLE,
    ByteMLP,
    Config,
    Result,
    Variant,
    fixed_eval_sets,
    load_corpus,
    train,
)

__all__ = ["TABLE", "VARIANTS", "main", "report", "write_table"]


# Hyperparameters of the rows, chosen before any run of this demo and not tuned against it:
# - Adam, OnebitAdam, ZeroOneAdam share lr = cfg.lr. Adam and OnebitAdam use torch's default
#   betas (0.9, 0.999); OnebitAdam has Adam's bias correction, so its v̂ frozen at the warmup is
#   on the right scale.
# - ZeroOneAdam: var_freeze_step = cfg.warmup, the same warmup as OnebitAdam's freeze_step.
#   var_update_scaler keeps its default 16 (it counts variance updates per interval, not steps:
#   variance steps 1–16, then every 2nd step, then every 4th up to the warmup). The default
#   local_step_scaler (32768) is meant for runs of ~10^5 steps; it is scaled to the run length as
#   a quarter of the steps, so the local interval doubles twice in phase B (1 → 2 → 4; the
#   default clipper 16 is not reached). SPEC §4 has no bias correction, so v frozen at step T_v
#   is (1 − β2^T_v) of its steady value: β2 follows the rule stated in
#   docs/algorithms/zero_one_adam.md and in the tests, T_v ≥ 3/(1 − β2) (v at 95 % of its level),
#   i.e. β2 = 1 − 3/T_v (0.96 for the default warmup of 75), not torch's 0.999.
#   Measured history (4 ranks, 300/75 steps): with β2 = 0.999 (v frozen at 7 % of its level)
#   ZeroOneAdam diverged in phase A, around step 60, and still does (step ≈ 83) now that commopt
#   leaves elements with v = 0 alone: rows of bytes seen once or twice on a variance step have
#   v ~ 1e-15, and the 1-bit gradient of the other steps, ±scale on every element, moves them by
#   ~1e4·lr per step. With β2 = 1 − 3/T_v it trains: val loss 2.134 against Adam's 2.111
#   (Adam and OnebitAdam with β2 = 0.999) at 6.9× less traffic, on a quiet machine.
#   Before commopt's zero-variance guard it diverged even with β2 = 0.99: ~4900 embedding
#   elements (bytes absent from every variance-step batch) kept v = 0 exactly.
# - LAMB: lr = 5·cfg.lr. LAMB scales each layer's update to lr·‖p‖ (trust ratio), so its lr is
#   a relative step size and is usually set larger than Adam's; 5× is a round a-priori choice.
#   The uncompressed LAMB row is commopt.OnebitLamb with freeze_step = cfg.steps + 1: it never
#   leaves the SPEC §3 warmup, which is exactly LAMB (no bias correction, clamped trust ratio)
#   on gradients the optimizer averages in fp32 (one all_reduce per step + the 16-byte flags).
#   OnebitLamb uses the same lr and freeze_step = cfg.warmup (OnebitAdam's warmup).
# - DiLoCo-1bit: the Adam row's optimizer, its gradients left local, inside commopt.DiLoCo with
#   its defaults (the syncs of the first 50 steps at fp32, then a 1-bit pseudo-gradient with
#   error feedback, one scale per tensor, outer lr 1.3, no outer momentum; chosen on the
#   convergence suite, docs/algorithms/diloco.md, not here)
#   and H = 10, the smallest H the issue asks about.
def _settled_beta2(freeze_step: int) -> float:
    """β2 whose uncorrected v has reached 95 % of its level by ``freeze_step``: 1 − 3/T."""
    return min(0.999, max(0.9, 1 - 3 / freeze_step))


def _lamb_lr(cfg: Config) -> float:
    return 5 * cfg.lr


VARIANTS: list[Variant] = [
    Variant(
        "Adam",
        lambda params, cfg: torch.optim.Adam(params, lr=cfg.lr),
        average_gradients=True,
        compression_from=None,
        description="torch.optim.Adam; gradients averaged by one fp32 all_reduce per step",
    ),
    Variant(
        "OnebitAdam",
        lambda params, cfg: commopt.OnebitAdam(params, lr=cfg.lr, freeze_step=cfg.warmup),
        average_gradients=False,
        compression_from=lambda cfg: cfg.warmup + 1,
        description="commopt.OnebitAdam(freeze_step=warmup): Adam warmup, then 1-bit momentum",
    ),
    Variant(
        "ZeroOneAdam",
        lambda params, cfg: commopt.ZeroOneAdam(
            params,
            lr=cfg.lr,
            betas=(0.9, _settled_beta2(cfg.warmup)),
            var_freeze_step=cfg.warmup,
            var_update_scaler=16,
            local_step_scaler=max(1, cfg.steps // 4),
            local_step_clipper=16,
        ),
        average_gradients=False,
        compression_from=lambda cfg: cfg.warmup + 1,  # phase B (phase A mixes fp32 and 1-bit)
        description="commopt.ZeroOneAdam(betas=(0.9, 1-3/warmup), var_freeze_step=warmup, "
        "local_step_scaler=steps//4): "
        "fp32 variance steps + 1-bit gradients, then local steps with 1-bit syncs (m, v "
        "bias-corrected)",
    ),
    Variant(
        "LAMB",
        lambda params, cfg: commopt.OnebitLamb(params, lr=_lamb_lr(cfg), freeze_step=cfg.steps + 1),
        average_gradients=False,
        compression_from=None,
        description="commopt.OnebitLamb(lr=5·lr, freeze_step=steps+1) = LAMB on fp32-averaged "
        "gradients (never leaves the SPEC §3 warmup)",
    ),
    Variant(
        "OnebitLamb",
        lambda params, cfg: commopt.OnebitLamb(params, lr=_lamb_lr(cfg), freeze_step=cfg.warmup),
        average_gradients=False,
        compression_from=lambda cfg: cfg.warmup + 1,
        description="commopt.OnebitLamb(lr=5·lr, freeze_step=warmup): LAMB warmup, then one "
        "fused 1-bit momentum allreduce per step; trust ratios max(frozen c̄·f, LAMB's ‖p‖/‖u‖)",
    ),
    Variant(
        "DiLoCo-1bit",
        lambda params, cfg: commopt.DiLoCo(
            torch.optim.Adam(params, lr=cfg.lr), sync_every=cfg.sync_every
        ),
        average_gradients=False,
        # the 1-bit stage starts after the syncs the defaults run at fp32
        compression_from=lambda cfg: (
            default_fp32_syncs("onebit", cfg.sync_every) * cfg.sync_every + 1
        ),
        description="commopt.DiLoCo(torch.optim.Adam(lr), sync_every=H): H local Adam steps, "
        "then the pseudo-gradient averaged at fp32 for the syncs of the first 50 steps, then "
        "at 1 bit with error feedback; outer lr 1.3",
    ),
]


# -- report --------------------------------------------------------------------------------------
def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f} MB"


TABLE = DEMO_TABLE
"""Where a run with the default settings writes its table; the README quotes it
(tests/unit/test_readme_demo_table.py) and a test re-trains the six rows and compares."""


def settings_line(cfg: Config, n: int, numel: int) -> str:
    return (
        f"{n} ranks, {cfg.steps} steps, batch {cfg.batch}/rank, {numel:,} parameters; "
        f"compressed optimizers: {cfg.warmup} warmup steps (ZeroOneAdam: variance-freeze "
        "phase), then 1-bit"
    )


def table(
    variants: list[Variant], results: list[Result], cfg: Config, times: bool = True
) -> list[str]:
    """The comparison table as Markdown lines. Without ``times`` every column is a pure
    function of the code and the settings (the same bits on every run): that is the table the
    demo writes to a file and the README quotes."""
    base = results[0]
    widths = (12, 7, 7, 7, 8, 6, 6, 6, 5, 5, 7, 6)[: 12 if times else 10]
    head = (
        f"| {'optimizer':<12} | {'train':>7} | {'val':>7} | {'val@wu':>7} | {'MB/rank':>8} "
        f"| {'x all':>6} | {'x 1bit':>6} | {'calls':>6} | {'fp32':>5} | {'1-bit':>5} |"
    )
    lines = [
        head + (f" {'ms/step':>7} | {'opt ms':>6} |" if times else ""),
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    for variant, r in zip(variants, results, strict=True):
        total = sum(r.step_bytes)
        ratio = sum(base.step_bytes) / total if total else math.inf
        if variant.compression_from is not None:
            start = variant.compression_from(cfg) - 1
            mine = sum(r.step_bytes[start:])
            stage = f"{sum(base.step_bytes[start:]) / mine:.1f}x" if mine else "inf"
        else:
            stage = "-"
        row = (
            f"| {r.label:<12} | {r.train_loss:7.4f} | {r.val_loss:7.4f} "
            f"| {r.loss_at_warmup:7.4f} | {total / 1e6:8.2f} | {ratio:5.1f}x | {stage:>6} "
            f"| {r.calls:6d} | {r.full_rounds:5d} | {r.compressed_rounds:5d} |"
        )
        if times:
            row += f" {statistics.median(r.step_ms):7.1f} | {statistics.median(r.opt_ms):6.1f} |"
        lines.append(row)
    return lines


def write_table(
    path: pathlib.Path,
    variants: list[Variant],
    results: list[Result],
    cfg: Config,
    n: int,
    numel: int,
) -> None:
    """Write the deterministic table (no timings) with the settings that produced it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = [settings_line(cfg, n, numel), "", *table(variants, results, cfg, times=False)]
    path.write_text("\n".join(body + headline(results, cfg, numel)) + "\n")


def headline(results: list[Result], cfg: Config, numel: int) -> list[str]:
    """DiLoCo's row against the first row's, in one sentence (nothing when it did not run)."""
    base = results[0]
    row = next((r for r in results if r.label == "DiLoCo-1bit"), None)
    if row is None or row is base:
        return []
    sent = sum(row.step_bytes)
    bits = 8 * sent / (numel * cfg.steps)
    variant = next(v for v in VARIANTS if v.label == row.label)
    start = variant.compression_from(cfg) - 1  # the 1-bit stage, as the table's "x 1bit"
    fp32 = start // cfg.sync_every  # the syncs before it
    start = min(start, cfg.steps)
    stage = 8 * sum(row.step_bytes[start:]) / (numel * max(1, cfg.steps - start))
    return [
        "",
        f"**DiLoCo-1bit** (H = {cfg.sync_every}): validation loss {row.val_loss:.4f}, "
        f"{100 * (row.val_loss / base.val_loss - 1):+.1f} % from {base.label}'s, with "
        f"{sum(base.step_bytes) / sent:.0f}x less traffic over the run ({bits:.3f} bits per "
        f"parameter per step, its first {fp32} syncs at fp32; {stage:.3f} in the 1-bit stage "
        "after them).",
    ]


def report(variants: list[Variant], results: list[Result], cfg: Config, n: int, numel: int) -> str:
    lines = [
        "",
        settings_line(cfg, n, numel),
        "loss = cross-entropy in nats/byte (bits/byte = nats/byte / ln 2) on fixed "
        f"{cfg.eval_contexts}-context samples",
        "",
        *table(variants, results, cfg),
    ]
    differ = [r.label for r in results if not r.identical]
    lines.append(
        "replicas bit-identical on every rank after training: "
        + ("yes, every row" if not differ else f"NO for {differ}")
    )
    lines += [
        f"{r.label}: {r.skipped_steps} of {cfg.steps} steps skipped (non-finite gradient), "
        "which is why its rounds do not add up to the steps"
        for r in results
        if r.skipped_steps
    ]
    lines += [
        "",
        f"Columns: train / val = final losses; val@wu = validation loss at step {cfg.warmup} "
        "(end of warmup); MB/rank = megabytes sent per rank; x all = traffic ratio against the "
        "first row over the whole run, x 1bit = over the compression stage alone; calls = "
        "collective calls per rank; fp32 / 1-bit = rounds; ms/step = median step time, opt ms "
        "= its optimizer + communication part.",
        "bytes: commopt's modelled per-rank bytes over the training steps (SPEC §7: ring "
        "all_reduce 2(n-1)/n·B; compressed 2(n-1)/n·N/8 + scales; plus a 16-byte flag all_reduce "
        "per commopt step). collective calls: every call of the commopt backend per rank over "
        "the training steps (commopt's flag all_reduce and the 3 all_gathers + 1 all_to_all of "
        "each compressed_allreduce included); fp32 / 1-bit rounds: full-precision averagings and "
        "compressed_allreduce calls (optimizer.comm_stats(); for torch.optim.Adam the loop's "
        "all_reduce calls). ms/step: median wall time of forward+backward+communication+update "
        "on this rank-0 process. Here the ranks talk over loopback and share the CPU cores, so "
        "time per step measures computation, not a network; for the emulated 1 Gbit/s network "
        "see docs/performance.md.",
        *(f"{v.label}: {v.description}" for v in variants),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    defaults = Config()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Config):
        parser.add_argument(
            f"--{field.name.replace('_', '-')}",
            type=type(getattr(defaults, field.name)),
            default=getattr(defaults, field.name),
        )
    labels = [v.label for v in VARIANTS]
    parser.add_argument(
        "--optimizers",
        default=",".join(labels),
        help=f"comma-separated subset of {labels}; the first is the baseline of the ratios",
    )
    args = parser.parse_args(argv)
    cfg = Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)})
    wanted = [s.strip() for s in args.optimizers.split(",") if s.strip()]
    unknown = [w for w in wanted if w not in labels]
    if unknown:
        parser.error(f"unknown optimizer(s) {unknown}; choose from {labels}")
    selected = [next(v for v in VARIANTS if v.label == w) for w in wanted]

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # A collective that waits longer than this fails loudly instead of hanging the demo.
    backend = commopt.init(timeout=float(os.environ.get("COMMOPT_DEMO_TIMEOUT", "300")))
    rank, n = backend.rank, backend.world_size

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    t_start = time.perf_counter()
    train_data, val_data, n_train, n_val = load_corpus(cfg.max_corpus_bytes)
    eval_sets = fixed_eval_sets(train_data, val_data, cfg)
    numel = sum(p.numel() for p in ByteMLP(cfg.context, cfg.embed, cfg.hidden).parameters())
    log(
        f"commopt demo: {n} ranks on backend {backend!r}, torch {torch.__version__}, "
        f"python {sys.version.split()[0]}, compressed-allreduce kernels: "
        f"{get_kernels(torch.device('cpu')).name}\n"
        f"corpus: standard library at {sysconfig.get_paths()['stdlib']}: "
        f"{n_train} train files ({len(train_data) / 1e6:.1f} MB), "
        f"{n_val} validation files ({len(val_data) / 1e6:.1f} MB)"
    )
    results = []
    for variant in selected:
        log(f"training with {variant.label}: {variant.description}")
        # Warnings (the same on every rank) would otherwise land in the middle of the progress
        # lines, once per rank: collect them and let rank 0 print each distinct one after them.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results.append(train(variant, cfg, backend, train_data, eval_sets, log))
        seen: dict[str, int] = {}
        for w in caught:
            text = f"{w.category.__name__}: {w.message}"
            seen[text] = seen.get(text, 0) + 1
        for text, count in seen.items():
            log(f"  warning ({variant.label}{f', {count} times' if count > 1 else ''}): {text}")
    log(report(selected, results, cfg, n, numel))
    if rank == 0:
        # Only the default settings' table is the README's; any other run writes beside it.
        default = cfg == defaults and [v.label for v in selected] == labels and n == 4
        path = TABLE if default else TABLE.with_name("table-custom.md")
        write_table(path, selected, results, cfg, n, numel)
        log(f"table written to {path}")
    log(f"total time {time.perf_counter() - t_start:.0f} s")
    if dist.is_initialized():
        dist.barrier()
    commopt.shutdown()
    return 0 if all(r.identical for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
