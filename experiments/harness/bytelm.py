r"""The demo's byte-level language model, as a task of the harness: the corpus, the model, the
optimizer rows (:class:`Variant`) and one training run (:func:`train`), over the harness's one
training loop (:func:`~experiments.harness.training.train_on_task`).

Corpus: the Python standard library's own ``.py`` files (``sysconfig.get_paths()["stdlib"]``,
without ``site-packages``, ``test`` and ``idlelib``), read in sorted order. A file goes to the
validation set when ``crc32(relative path) % 10 == 0``, so the split is by file and the same on
every rank and every run on a given Python installation.

Model: a Bengio-style neural n-gram model over bytes. The previous ``context`` bytes are embedded,
concatenated and fed to a two-layer GELU MLP that predicts the next byte (256-way softmax). The
loss is cross-entropy in nats per byte (divide by ln 2 for bits per byte).

Every row trains the same model from the same initial weights (rank 0's, via
``commopt.broadcast_parameters``) on the same batches: step t draws one global batch of
``n·batch`` positions from a generator seeded with ``seed``; rank r trains on slice r. Bytes sent
are the commopt backend's modelled per-rank bytes (``backend.stats``, SPEC §7) over the training
steps only; evaluation uses ``torch.distributed`` directly and is not counted.

The demo (``experiments/demo/train_bytelm.py``) is its rows and its table over this module; the
algorithm studies on the same problem (experiments/algorithms, experiments/diloco) train their
own rows with the same :func:`train`.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import statistics
import sysconfig
import zlib
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

import commopt
from experiments.harness.training import (
    Setup,
    rank_and_size,
    replicas_identical,
    sum_over_ranks,
    train_on_task,
)

__all__ = [
    "DEMO_TABLE",
    "ByteMLP",
    "Config",
    "Result",
    "Variant",
    "contexts",
    "evaluate",
    "fixed_eval_sets",
    "load_corpus",
    "train",
]

_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}

DEMO_TABLE = pathlib.Path(__file__).parents[1] / "demo" / "results" / "table.md"
"""Where the demo's run with the default settings writes its table; the README quotes it
(tests/unit/test_readme_demo_table.py) and a test re-trains the six rows and compares."""


# -- configuration and a row ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a run depends on (identical on every rank)."""

    steps: int = 300
    """optimizer steps per variant"""
    warmup: int = 75
    """full-precision warmup steps of the compressed optimizers (OnebitAdam's freeze_step)"""
    batch: int = 64
    """contexts per rank per step"""
    context: int = 32
    """bytes of context the model sees"""
    embed: int = 32
    hidden: int = 384
    lr: float = 2e-3
    seed: int = 0
    eval_contexts: int = 4096
    """contexts in each of the fixed train and validation evaluation sets"""
    log_every: int = 25
    max_corpus_bytes: int = 12_000_000
    sync_every: int = 10
    """DiLoCo's H: inner steps between two syncs of the pseudo-gradient"""


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row of the table: how to build the optimizer and how it communicates.

    ``make(params, cfg)`` returns the optimizer. ``average_gradients``: the training loop
    all-reduces the gradients (fp32, one flat buffer per step) before ``step()``; use it for
    plain ``torch.optim`` optimizers. The commopt optimizers average on their own.
    ``compression_from(cfg)`` is the first step of the compression stage (``None``: never).
    """

    label: str
    make: Callable[[Iterable[nn.Parameter], Config], torch.optim.Optimizer]
    average_gradients: bool
    compression_from: Callable[[Config], int] | None
    description: str


# -- data ----------------------------------------------------------------------------------------
def load_corpus(max_bytes: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(train bytes, validation bytes, train files, validation files) from the stdlib sources."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if not _EXCLUDED_DIRS & set(p.relative_to(root).parts[:-1])
    )
    train, val, total = [], [], 0
    for path in files:
        rel = path.relative_to(root).as_posix()
        data = path.read_bytes()
        if total + len(data) > max_bytes:
            break
        total += len(data)
        (val if zlib.crc32(rel.encode()) % 10 == 0 else train).append(data)
    if not train or not val:
        raise RuntimeError(f"found too few standard-library sources under {root}")

    def as_tensor(parts: list[bytes]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"\n".join(parts)), dtype=torch.uint8).long()

    return as_tensor(train), as_tensor(val), len(train), len(val)


def fixed_eval_sets(
    train_data: torch.Tensor, val_data: torch.Tensor, cfg: Config
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{"train", "val"} → (bytes, ``cfg.eval_contexts`` fixed window starts), seeded by cfg."""
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    return {
        name: (
            data,
            torch.randint(0, len(data) - cfg.context - 1, (cfg.eval_contexts,), generator=gen),
        )
        for name, data in (("train", train_data), ("val", val_data))
    }


def contexts(
    data: torch.Tensor, starts: torch.Tensor, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [B, context] and next-byte targets [B] for windows starting at ``starts``."""
    idx = starts[:, None] + torch.arange(context + 1)
    windows = data[idx]
    return windows[:, :-1], windows[:, -1]


# -- model ---------------------------------------------------------------------------------------
class ByteMLP(nn.Module):
    """Embed ``context`` bytes, concatenate, two GELU layers, logits over the next byte."""

    def __init__(self, context: int, embed: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, embed)
        self.net = nn.Sequential(
            nn.Linear(context * embed, hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, 256),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.embed(x).flatten(1))


# -- one training run ----------------------------------------------------------------------------
@dataclasses.dataclass
class Result:
    label: str
    train_loss: float
    val_loss: float
    loss_at_warmup: float
    step_bytes: list[int]
    step_ms: list[float]
    opt_ms: list[float]
    calls: int
    """collective calls of the commopt backend over the training steps (flags included)"""
    full_rounds: int
    """full-precision (fp32) averaging rounds"""
    compressed_rounds: int
    """1-bit compressed_allreduce rounds"""
    skipped_steps: int
    """steps a commopt optimizer skipped on every rank (non-finite gradient somewhere)"""
    identical: bool


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, starts: torch.Tensor, cfg: Config) -> float:
    """Mean loss over ``starts`` (every rank evaluates its share; the sum is all-reduced)."""
    rank, n = rank_and_size()
    mine = starts[rank::n]
    total = 0.0
    for piece in mine.split(1024):
        x, y = contexts(data, piece, cfg.context)
        total += float(F.cross_entropy(model(x), y, reduction="sum"))
    loss_sum, count = sum_over_ranks([total, float(len(mine))])
    return loss_sum / count


class _Batches:
    """The run's batches as a harness task: one generator seeded ``seed + 1`` draws a global
    batch per step, in step order (:func:`train_on_task` asks for steps 1, 2, … in turn); rank r
    takes slice r. Evaluation is the validation loss; the last batch loss is kept for the log."""

    def __init__(self, cfg: Config, rank: int, n: int, data: torch.Tensor, val: tuple) -> None:
        self.cfg, self.rank, self.n, self.data, self.val = cfg, rank, n, data, val
        self._gen = torch.Generator().manual_seed(cfg.seed + 1)
        self._high = len(data) - cfg.context - 1
        self.last_loss = math.nan

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        del step  # (drawn in order)
        cfg = self.cfg
        starts = torch.randint(0, self._high, (self.n * cfg.batch,), generator=self._gen)
        mine = starts[self.rank * cfg.batch : (self.rank + 1) * cfg.batch]
        return contexts(self.data, mine, cfg.context)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        self.last_loss = float(loss.detach())
        return loss

    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        val = evaluate(model, *self.val, self.cfg)
        return val, val


def train(
    variant: Variant,
    cfg: Config,
    backend: commopt.Backend,
    train_data: torch.Tensor,
    eval_sets: dict[str, tuple[torch.Tensor, torch.Tensor]],
    log: Callable[[str], None],
) -> Result:
    """Train ``variant`` for ``cfg.steps`` steps (the harness's loop); its row of the table."""
    rank, n = backend.rank, backend.world_size
    torch.manual_seed(cfg.seed)
    model = ByteMLP(cfg.context, cfg.embed, cfg.hidden)
    commopt.broadcast_parameters(model, backend=backend)
    optimizer = variant.make(model.parameters(), cfg)
    setup = Setup(variant.label, model, optimizer, backend, None, variant.average_gradients)
    task = _Batches(cfg, rank, n, train_data, eval_sets["val"])
    compression_from = variant.compression_from(cfg) if variant.compression_from else None
    step_bytes: list[int] = []
    step_ms: list[float] = []
    opt_ms: list[float] = []
    calls0 = backend.stats.calls
    last = {"bytes": backend.stats.bytes_sent, "seconds": 0.0, "step": 0.0}
    at = {"warmup": math.nan, "end": math.nan}

    def record(step: int, evaluation: tuple[float, float] | None, seconds: float) -> None:
        step_bytes.append(setup.bytes_sent - last["bytes"])
        step_ms.append((seconds - last["seconds"]) * 1e3)
        opt_ms.append((setup.seconds["step"] - last["step"]) * 1e3)
        last.update(bytes=setup.bytes_sent, seconds=seconds, step=setup.seconds["step"])
        if evaluation is not None:
            at["end"] = evaluation[0]
            if step == cfg.warmup:
                at["warmup"] = evaluation[0]
        if step % cfg.log_every == 0 or step == cfg.steps:
            stage = ""
            if compression_from is not None:
                stage = " [1-bit]" if step >= compression_from else " [warmup]"
            log(
                f"  {variant.label:<12} step {step:4d}/{cfg.steps}"
                f"  batch loss {task.last_loss:.3f}"
                f"  {statistics.median(step_ms[-cfg.log_every :]):6.1f} ms/step{stage}"
            )

    # evaluated at the end of the warmup (val@wu) and at the end; every warmup-th step between
    every = cfg.warmup if 0 < cfg.warmup <= cfg.steps else cfg.steps
    train_on_task(task, setup, cfg.steps, every, record)
    calls = backend.stats.calls - calls0
    if isinstance(optimizer, commopt.DiLoCo):
        stats = optimizer.comm_stats()
        full_rounds, skipped = stats["syncs_at_fp32"], 0
        compressed_rounds = stats["syncs"] - full_rounds
    elif isinstance(optimizer, commopt.optim.CompressedOptimizer):
        stats = optimizer.comm_stats()
        full_rounds, compressed_rounds = stats["full_precision_rounds"], stats["compressed_rounds"]
        skipped = stats["skipped_steps"]
    else:  # a torch.optim optimizer: the loop's fp32 all_reduce per step is the only round
        full_rounds, compressed_rounds, skipped = (
            cfg.steps if variant.average_gradients else 0,
            0,
            0,
        )
    return Result(
        label=variant.label,
        train_loss=evaluate(model, *eval_sets["train"], cfg),
        val_loss=at["end"],
        loss_at_warmup=at["warmup"],
        step_bytes=step_bytes,
        step_ms=step_ms,
        opt_ms=opt_ms,
        calls=calls,
        full_rounds=full_rounds,
        compressed_rounds=compressed_rounds,
        skipped_steps=skipped,
        identical=replicas_identical(model),
    )
