"""``overlap=True`` honours what the program does between backward and ``step()``:
``clip_grad_norm_`` (in every phase, the warmup included) and a change of β1 (OneCycleLR's
``cycle_momentum``) used to be ignored, or broke bit-identity, because the early work had
already read the gradients and β1. Now ``step()`` sees that what the work read has changed,
agrees on it with every rank, and redoes the step as ``overlap=False`` would: the same bits,
and one warning on rank 0."""

from __future__ import annotations

import hashlib
import warnings

import pytest
import torch

from tests.multirank.harness import run_ranks
from tests.optim_registry import OPTIMIZERS

WORLD = 2


def _train(backend, name: str, overlap: bool, habit: str) -> dict:
    info = next(i for i in OPTIMIZERS if i.name == name)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
    opt = info.make(model.parameters(), backend=backend, overlap=overlap, bucket_numel=200)
    gen = torch.Generator().manual_seed(backend.rank)
    digests, rounds = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, info.steps + 1):
            opt.zero_grad()
            x, y = torch.randn(6, 10, generator=gen), torch.randn(6, 3, generator=gen)
            (10 * torch.nn.functional.mse_loss(model(x), y)).backward()
            if habit == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
            elif habit == "beta1" and step % 2 == 0:
                for group in opt.param_groups:
                    group["betas"] = (0.85 + 0.01 * step, group["betas"][1])
            opt.step()
            stats = opt.comm_stats()
            rounds.append(stats["full_precision_rounds"] + stats["compressed_rounds"])
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            digests.append(hashlib.sha1(flat.numpy().tobytes()).hexdigest()[:16])
    redone = [str(w.message) for w in caught if "was redone as overlap=False" in str(w.message)]
    per_step = [b - a for a, b in zip([0, *rounds], rounds, strict=False)]
    return {"digests": digests, "redone": redone, "rounds": per_step}


@pytest.mark.parametrize("habit", ["clip", "beta1"])
@pytest.mark.parametrize("name", [i.name for i in OPTIMIZERS])
def test_overlap_equals_overlap_false_under_the_habit(name: str, habit: str) -> None:
    on = run_ranks(_train, WORLD, name, True, habit, timeout=180)
    off = run_ranks(_train, WORLD, name, False, habit, timeout=180)
    assert [r["digests"] for r in on] == [r["digests"] for r in off]
    assert len(on[0]["redone"]) == 1 and on[1]["redone"] == []
    assert off[0]["redone"] == []
    # The communication is paid twice in the first step that changed what the work read, and
    # once in every other: after the redo the optimizer runs as overlap=False.
    pairs = zip(on[0]["rounds"], off[0]["rounds"], strict=True)
    differ = [k for k, (a, b) in enumerate(pairs) if a != b]
    assert len(differ) == 1 and on[0]["rounds"][differ[0]] > off[0]["rounds"][differ[0]]


def test_no_redo_without_the_habit() -> None:
    for info in OPTIMIZERS:
        on = run_ranks(_train, WORLD, info.name, True, "none", timeout=180)
        assert on[0]["redone"] == [] and on[1]["redone"] == []
