r"""The two convergence tasks: a byte-level GPT on the standard library, a CNN on sklearn digits.

A task yields, for global step t, the same global batch on every rank (drawn from a generator
seeded with ``seed``) and rank r trains on slice r of it, so every variant sees the same data in
the same order. Evaluation is on a fixed validation sample (split by file for the LM, a fixed
stratified split for digits); each rank evaluates its share and the sums are all-reduced.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from experiments.harness.training import rank_and_size, sum_over_ranks

__all__ = ["TASKS", "DigitsTask", "LMTask", "Task", "TinyGPT", "load_task"]


class Task(Protocol):
    name: str
    metric_name: str

    def build_model(self) -> nn.Module: ...

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor: ...

    def evaluate(self, model: nn.Module) -> tuple[float, float]: ...

    def describe(self) -> str: ...


# -- language model ------------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Pre-LayerNorm causal transformer over bytes: token + learned position embeddings,
    ``layers`` blocks of multi-head self-attention and a 4× GELU MLP, a linear head (256)."""

    def __init__(self, context: int, d: int, heads: int, layers: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


@dataclasses.dataclass
class LMTask:
    """Next-byte prediction on the Python standard library's ``.py`` sources.

    The corpus and its by-file split (``crc32(path) % 10 == 0`` → validation) are the demo's
    (:func:`experiments.harness.bytelm.load_corpus`). Loss: mean cross-entropy over every
    position of a ``context``-byte window; the metric is validation bits per byte.
    """

    batch_per_rank: int = 16
    context: int = 64
    d: int = 64
    heads: int = 4
    layers: int = 2
    seed: int = 0
    eval_windows: int = 256
    max_corpus_bytes: int = 8_000_000
    name: str = "lm"
    metric_name: str = "val bits/byte"

    def __post_init__(self) -> None:
        from experiments.harness.bytelm import load_corpus

        self.train, self.val, self.n_train, self.n_val = load_corpus(self.max_corpus_bytes)
        gen = torch.Generator().manual_seed(self.seed + 2)
        self.val_starts = torch.randint(
            0, len(self.val) - self.context - 1, (self.eval_windows,), generator=gen
        )

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return TinyGPT(self.context, self.d, self.heads, self.layers)

    def _windows(self, data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        w = data[starts[:, None] + torch.arange(self.context + 1)]
        return w[:, :-1], w[:, 1:]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rank, n = rank_and_size()
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(
            0, len(self.train) - self.context - 1, (n * self.batch_per_rank,), generator=gen
        )
        mine = starts[rank * self.batch_per_rank : (rank + 1) * self.batch_per_rank]
        return self._windows(self.train, mine)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        """(validation loss in nats/byte, bits/byte)."""
        rank, n = rank_and_size()
        x, y = self._windows(self.val, self.val_starts[rank::n])
        total = float(F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum"))
        s, count = sum_over_ranks([total, float(y.numel())])
        return s / count, s / count / math.log(2)

    def describe(self) -> str:
        params = sum(p.numel() for p in self.build_model().parameters())
        return (
            f"byte-level GPT ({self.layers} layers, d={self.d}, {self.heads} heads, context "
            f"{self.context}, {params:,} parameters) on the Python standard library: "
            f"{self.n_train} train files ({len(self.train) / 1e6:.1f} MB), {self.n_val} "
            f"validation files ({len(self.val) / 1e6:.1f} MB); batch {self.batch_per_rank} "
            f"windows/rank; validation on {self.eval_windows} fixed windows "
            f"({self.eval_windows * self.context:,} bytes)"
        )


# -- digits --------------------------------------------------------------------------------------
_ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}


class _DigitsCNN(nn.Module):
    def __init__(self, width: int, activation: str) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation={activation!r}: choose from {sorted(_ACTIVATIONS)}")
        act = _ACTIVATIONS[activation]
        self.net = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            act(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            act(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * width * 16, 128),
            act(),
            nn.Linear(128, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@dataclasses.dataclass
class DigitsTask:
    """scikit-learn's bundled 8×8 digits (1 797 images, offline): a small CNN, 10 classes.

    Split: a fixed stratified 20 % validation set (per class, a seeded permutation). Inputs
    scaled to [0, 1]. The metric is validation accuracy in percent.
    """

    batch_per_rank: int = 16
    width: int = 16
    activation: str = "gelu"
    """"gelu" (default) or "relu": with ReLU, dead units leave coordinates with v ≈ 0 that the
    1-bit optimizers' shared scale then blows up (docs/experiments.md)"""
    seed: int = 0
    name: str = "digits"
    metric_name: str = "val accuracy %"

    def __post_init__(self) -> None:
        from sklearn.datasets import load_digits

        data = load_digits()
        x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
        y = torch.tensor(data.target, dtype=torch.long)
        gen = torch.Generator().manual_seed(self.seed + 7)
        val_idx = []
        for c in range(10):
            idx = (y == c).nonzero().flatten()
            idx = idx[torch.randperm(len(idx), generator=gen)]
            val_idx.append(idx[: len(idx) // 5])
        is_val = torch.zeros(len(y), dtype=torch.bool)
        is_val[torch.cat(val_idx)] = True
        self.x_train, self.y_train = x[~is_val], y[~is_val]
        self.x_val, self.y_val = x[is_val], y[is_val]

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return _DigitsCNN(self.width, self.activation)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rank, n = rank_and_size()
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        idx = torch.randint(0, len(self.y_train), (n * self.batch_per_rank,), generator=gen)
        mine = idx[rank * self.batch_per_rank : (rank + 1) * self.batch_per_rank]
        return self.x_train[mine], self.y_train[mine]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        """(validation loss in nats, validation accuracy in %)."""
        rank, n = rank_and_size()
        x, y = self.x_val[rank::n], self.y_val[rank::n]
        logits = model(x)
        total = float(F.cross_entropy(logits, y, reduction="sum"))
        correct = float((logits.argmax(1) == y).sum())
        s, c, count = sum_over_ranks([total, correct, float(len(y))])
        return s / count, 100.0 * c / count

    def describe(self) -> str:
        params = sum(p.numel() for p in self.build_model().parameters())
        return (
            f"CNN (2 conv of width {self.width}/{2 * self.width}, 2 linear, {self.activation}; "
            f"{params:,} "
            f"parameters) on scikit-learn digits: {len(self.y_train)} train / {len(self.y_val)} "
            f"validation images; batch {self.batch_per_rank}/rank"
        )


TASKS = {"lm": LMTask, "digits": DigitsTask}


def load_task(name: str, **overrides: object) -> Task:
    """Instantiate task ``name`` (``"lm"`` or ``"digits"``) with dataclass field overrides."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {sorted(TASKS)}")
    return TASKS[name](**overrides)
