"""The small problems of the 1-bit LAMB and 0/1 Adam convergence checks
(tests/multirank/test_lamb_zero_one_gloo.py) and of experiments/algorithms/trust_ratio.py: a
linear regression (0/1 Adam, the problem of 1-bit Adam's test) and a wide MLP (1-bit LAMB), each
trained with a cosine lr on one rank's minibatches or on all ranks' mean.
"""

from __future__ import annotations

import math

import torch

from experiments.harness.training import Setup, train_on_task

__all__ = [
    "ADAM_BETAS",
    "ADAM_LR",
    "DIM",
    "LAMB_BATCH",
    "LAMB_BETAS",
    "LAMB_FREEZE_AT",
    "LAMB_LR",
    "LAMB_STEPS",
    "STEPS",
    "VAR_FREEZE",
    "fit",
    "fit_linear",
    "fit_mlp",
    "make_mlp",
    "minibatch_loss",
    "mlp_data",
    "regression_data",
]

LAMB_STEPS, LAMB_DIM, LAMB_HIDDEN = 750, 8, 32
LAMB_LR, LAMB_BETAS = 0.02, (0.9, 0.98)
LAMB_FREEZE_AT = LAMB_STEPS // 5  # the rule above, not a scanned value
LAMB_BATCH = 32

# 0/1 Adam keeps the regression problem of OnebitAdam's test (data, linear model, steps, cosine
# lr). It has no bias correction, so v must have settled when it is frozen: β2 = 0.99 here (with
# 0.999 and 30 steps √v is ~5× too small and 0/1 Adam lands 14 % above Adam); the counterpart
# Adam uses the same betas.
STEPS, DIM = 150, 20
ADAM_LR, ADAM_BETAS, VAR_FREEZE = 0.1, (0.9, 0.99), 30


def regression_data():
    gen = torch.Generator().manual_seed(123)
    x = torch.randn(4096, DIM, generator=gen)
    y = x @ torch.randn(DIM, 1, generator=gen) + 1.0 + 0.5 * torch.randn(4096, 1, generator=gen)
    return x, y


def mlp_data():
    """y = sin(x·a) + 0.5·tanh(x·b)·(x·c) + 0.1·noise, x ~ N(0, I₈); var(y) ≈ 0.6."""
    gen = torch.Generator().manual_seed(321)
    x = torch.randn(4096, LAMB_DIM, generator=gen)
    a, b, c = (torch.randn(LAMB_DIM, 1, generator=gen) / math.sqrt(LAMB_DIM) for _ in range(3))
    y = torch.sin(2 * x @ a) + 0.5 * torch.tanh(x @ b) * (x @ c)
    return x, y + 0.1 * torch.randn(4096, 1, generator=gen)


def make_mlp() -> torch.nn.Module:
    torch.manual_seed(2)
    return torch.nn.Sequential(
        torch.nn.Linear(LAMB_DIM, LAMB_HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(LAMB_HIDDEN, LAMB_HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(LAMB_HIDDEN, 1),
    )


class _FullData:
    """The whole data set as every step's batch, for a loss that draws its own minibatches
    (:func:`minibatch_loss`); evaluation is the full-data MSE on this rank."""

    def __init__(self, data: tuple[torch.Tensor, torch.Tensor], loss_fn) -> None:
        self.data, self.loss_fn = data, loss_fn

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        del step
        return self.data

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
        return self.loss_fn(model, *batch)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> tuple[float, float]:
        x, y = self.data
        mse = ((model(x) - y) ** 2).mean().item()
        return mse, mse


def fit(make_opt, model, data, steps: int, lr: float, loss_fn) -> float:
    """Train ``steps`` steps with a cosine lr on ``loss_fn(model, x, y)`` (the harness's loop,
    :func:`~experiments.harness.training.train_on_task`); full-data MSE."""
    opt = make_opt(model.parameters())

    def cosine(step: int) -> None:  # (steps counted from 1; the cosine from 0)
        opt.param_groups[0]["lr"] = lr * 0.5 * (1 + math.cos(math.pi * (step - 1) / steps))

    final: list[float] = []

    def record(step: int, evaluation: tuple[float, float] | None, seconds: float) -> None:
        if evaluation is not None:
            final.append(evaluation[0])

    setup = Setup("fit", model, opt, None, None, False)
    train_on_task(_FullData(data, loss_fn), setup, steps, steps, record, schedule=cosine)
    return final[-1]


def fit_linear(make_opt, loss_fn) -> float:
    torch.manual_seed(1)
    model = torch.nn.Linear(DIM, 1)
    return fit(make_opt, model, regression_data(), STEPS, ADAM_LR, loss_fn)


def fit_mlp(make_opt, loss_fn) -> float:
    return fit(make_opt, make_mlp(), mlp_data(), LAMB_STEPS, LAMB_LR, loss_fn)


def minibatch_loss(ranks: list[int], n: int, batch: int = 16):
    """The mean over ``ranks`` of each one's minibatch loss on its shard (own batch stream).

    One rank: what that rank computes; all ranks: what an fp32 allreduce of gradients gives.
    """
    streams = {r: torch.Generator().manual_seed(7 + r) for r in ranks}

    def loss(model, x, y):
        total = 0.0
        for r in ranks:
            xs, ys = x[r::n], y[r::n]
            idx = torch.randint(0, xs.shape[0], (batch,), generator=streams[r])
            total = total + ((model(xs[idx]) - ys[idx]) ** 2).mean()
        return total / len(ranks)

    return loss
