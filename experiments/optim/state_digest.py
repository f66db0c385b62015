"""sha256 of parameters and optimizer state after a fixed run (a refactor must change no bit).

Runs each optimizer on 4 forked gloo ranks through every phase (1-bit Adam and 1-bit LAMB:
warmup then compression; 0/1 Adam: variance and 1-bit steps, then local and sync steps), with
two param groups, weight decay, an ``exp_avg_mask``, a bf16 parameter, a dead input (zero
variance) and a parameter without gradient on one rank, and prints one digest per optimizer and
rank. Run it before and after a change; the lines must be identical.

    python -m experiments.optim.state_digest
    python -m experiments.optim.state_digest --step-guard off   # the papers' step (no guard)
    python -m experiments.optim.state_digest --rules papers

The default run uses the optimizers' defaults, so a change of a default changes its lines
(``step_guard="tiny"`` did: docs/algorithms/step_guard.md; so did 0/1 Adam's
``bias_correction=True``, docs/algorithms/zero_one_adam.md, and 1-bit LAMB's
``trust_ratio="max"``, docs/algorithms/onebit_lamb.md). ``--rules papers`` passes the papers'
rules where a default now goes beyond them (ZeroOneAdam ``bias_correction=False``, OnebitLamb
``trust_ratio="frozen"``): its lines are the default lines of the code before those two
defaults. ``--step-guard off`` is the papers' step: ``step_guard=False`` and the papers' rules,
and must print the lines of the code before the guard existed.
"""

from __future__ import annotations

import argparse
import hashlib

import torch

import commopt
from tests.multirank.harness import run_ranks

STEPS = 14


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(7, 24), torch.nn.Tanh(), torch.nn.Linear(24, 9), torch.nn.Linear(9, 3)
    )
    model[2].to(torch.bfloat16)
    return model


def _groups(model: torch.nn.Module) -> list[dict]:
    p = list(model.parameters())
    mask = torch.ones(24, 7)
    mask[5] = 0
    return [
        {"params": p[:1], "weight_decay": 0.01, "exp_avg_mask": mask},
        {"params": p[1:], "lr": 0.02, "betas": (0.8, 0.99)},
    ]


_OPTIMIZERS = {
    "OnebitAdam": lambda g, be, **kw: commopt.OnebitAdam(
        g, lr=0.01, freeze_step=5, backend=be, **kw
    ),
    "OnebitLamb": lambda g, be, **kw: commopt.OnebitLamb(
        g, lr=0.01, freeze_step=5, backend=be, **kw
    ),
    "ZeroOneAdam": lambda g, be, **kw: commopt.ZeroOneAdam(
        g,
        lr=0.01,
        var_freeze_step=7,
        var_update_scaler=2,
        local_step_scaler=2,
        local_step_clipper=4,
        backend=be,
        **kw,
    ),
}


def _digest(backend, name: str, options: dict) -> str:
    import warnings

    warnings.simplefilter("ignore")
    rank = backend.rank
    model = _model()
    opt = _OPTIMIZERS[name](_groups(model), backend, **options)
    h = hashlib.sha256()
    for t in range(1, STEPS + 1):
        gen = torch.Generator().manual_seed(100 * rank + t)
        x = torch.randn(16, 7, generator=gen)
        x[:, 3] = 0  # a dead input feature: its weights get zero gradient, hence zero variance
        hidden = model[1](model[0](x))
        out = model[3](model[2](hidden.to(torch.bfloat16)).float())
        loss = ((out - torch.sin(x[:, :3])) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        if rank == 1 and t % 3 == 0:
            model[3].bias.grad = None  # a gradient missing on one rank only
        opt.step()
        for p in model.parameters():
            h.update(p.detach().float().numpy().tobytes())
    sd = opt.state_dict()
    for pid in sorted(sd["state"]):
        for key in sorted(sd["state"][pid]):
            v = sd["state"][pid][key]
            if torch.is_tensor(v):
                h.update(key.encode())
                h.update(v.detach().float().reshape(-1).numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-guard", choices=("default", "off"), default="default")
    parser.add_argument("--rules", choices=("default", "papers"), default="default")
    args = parser.parse_args(argv)
    options = {"step_guard": False} if args.step_guard == "off" else {}
    papers = args.step_guard == "off" or args.rules == "papers"
    paper_rules = {
        "ZeroOneAdam": {"bias_correction": False},
        "OnebitLamb": {"trust_ratio": "frozen"},
    }
    for name in _OPTIMIZERS:
        extra = paper_rules.get(name, {}) if papers else {}
        digests = run_ranks(_digest, 4, name, {**options, **extra}, timeout=300)
        print(name, " ".join(digests))


if __name__ == "__main__":
    main()
