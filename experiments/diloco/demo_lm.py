# ruff: noqa: E402  (torch is imported after its CPU kernels are capped, below)
r"""DiLoCo variants on the README demo's byte-level LM, one seed, beside its committed table.

    python -m experiments.diloco.demo_lm --variants none-H10,onebit-H10,onebit-H10-tensor

Each variant is ``COMPRESSION-HK[-wW][-fS][-oR][-tensor]`` (compression, ``sync_every`` K,
warmup steps W, the first S syncs at fp32, outer lr R, one 1-bit scale per tensor; what is left
out takes commopt.DiLoCo's default) around the demo's Adam row, trained on the
demo's task with its settings (:mod:`experiments.harness.bytelm`: 4 forked gloo ranks, 300
steps, rank 0's weights, the same batches). Prints each variant's final validation loss and
its gap to the Adam row of the committed table (experiments/demo/results/table.md).
"""

from __future__ import annotations

from experiments.cpu_isa import cap_at_avx2

cap_at_avx2()  # before torch loads: the losses move with an ulp (see there)

import argparse
import re
import sys
from typing import Any

import torch

import commopt
from experiments.harness import bytelm, launch

__all__ = ["main", "parse"]

_SPEC = re.compile(
    r"(?P<c>none|bf16|onebit)-H(?P<h>\d+)(?:-w(?P<w>\d+))?(?:-f(?P<f>\d+))?(?:-o(?P<o>[\d.]+))?"
    r"(?P<t>-tensor)?"
)


def parse(spec: str) -> dict[str, Any]:
    """``commopt.DiLoCo`` keyword arguments for a variant label (module docstring)."""
    m = _SPEC.fullmatch(spec)
    if m is None:
        raise SystemExit(f"bad variant {spec!r}: expected COMPRESSION-HK[-wW][-fS][-oR][-tensor]")
    kw: dict[str, Any] = {"compression": m["c"], "sync_every": int(m["h"])}
    if m["w"]:
        kw["warmup_steps"] = int(m["w"])
    if m["f"]:
        kw["fp32_syncs"] = int(m["f"])
    if m["o"]:
        kw["outer_lr"] = float(m["o"])
    if m["t"]:
        kw["scale"] = "tensor"
    return kw


def _train(specs: list[str]) -> dict[str, float]:
    cfg = bytelm.Config()
    backend = commopt.comm.resolve_backend(None)
    train_data, val_data, _, _ = bytelm.load_corpus(cfg.max_corpus_bytes)
    eval_sets = bytelm.fixed_eval_sets(train_data, val_data, cfg)
    out = {}
    for spec in specs:
        kw = parse(spec)

        def make(params, c, kw=kw):
            return commopt.DiLoCo(torch.optim.Adam(params, lr=c.lr), **kw)

        variant = bytelm.Variant(spec, make, False, None, f"commopt.DiLoCo(Adam, {kw})")
        out[spec] = bytelm.train(variant, cfg, backend, train_data, eval_sets, lambda _: None)
    return {k: r.val_loss for k, r in out.items()}


def _adam_of_table() -> float:
    for line in bytelm.DEMO_TABLE.read_text().splitlines():
        if line.startswith("| Adam "):
            return float(line.split("|")[3])
    raise SystemExit(f"no Adam row in {bytelm.DEMO_TABLE}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="none-H10,onebit-H10")
    parser.add_argument("--timeout", type=float, default=3600.0)
    args = parser.parse_args(argv)
    specs = [s.strip() for s in args.variants.split(",") if s.strip()]
    for spec in specs:
        parse(spec)
    losses = launch(_train, 4, specs, timeout=args.timeout)
    if losses is None:  # not rank 0 under a launcher
        return 0
    adam = _adam_of_table()
    print(f"Adam (committed table): {adam:.4f}")
    for spec, loss in losses.items():
        print(f"DiLoCo {spec}: {loss:.4f} ({100 * (loss / adam - 1):+.1f} % from Adam)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
