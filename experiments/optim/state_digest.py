"""sha256 of parameters and optimizer state after a fixed run (a refactor must change no bit).

Runs each optimizer on 4 forked gloo ranks through every phase (1-bit Adam and 1-bit LAMB:
warmup then compression; 0/1 Adam: variance and 1-bit steps, then local and sync steps), with
two param groups, weight decay, an ``exp_avg_mask``, a bf16 parameter, a dead input (zero
variance) and a parameter without gradient on one rank, and prints one digest per optimizer and
rank. Run it before and after a change; the lines must be identical.

Each optimizer runs four ways, one line each: standalone, ``overlap=True`` (its work starts
from gradient hooks, on the communication thread), standalone with every gradient kept, and
under DDP with the commopt hook (``exchange_in_backward=True``: the compression stage's exchange
runs in backward), which must match the line before it. Overlap and the hook are bit-identical
to the standalone optimizer by design.

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
import commopt.ddp
from experiments.harness import run_ranks

STEPS = 14


class _Net(torch.nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self[1](self[0](x))
        return self[3](self[2](hidden.to(torch.bfloat16)).float())


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = _Net(
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


#: (how it runs, whether rank 1 drops a gradient after backward). Under DDP the gradients are
#: averaged during backward, so a gradient dropped after it is not a gradient the ranks agreed
#: to leave out: the DDP run keeps every gradient, and so does the standalone run it matches.
MODES = {
    "standalone": ("standalone", True),
    "overlap": ("overlap", True),
    "standalone-all-grads": ("standalone", False),
    "ddp-hook": ("ddp-hook", False),
}


def _digest(backend, name: str, options: dict, mode: str = "standalone", drop: bool = True) -> str:
    import warnings

    warnings.simplefilter("ignore")
    rank = backend.rank
    model = _model()
    overlap = {"overlap": True} if mode == "overlap" else {}
    opt = _OPTIMIZERS[name](_groups(model), backend, **options, **overlap)
    forward = model
    if mode == "ddp-hook":
        # The bf16 layer stays outside DDP (its gradients local, the optimizer buckets that hold
        # it completed from p.grad in step()): DDP would average its gradients in bf16, where
        # the standalone optimizer averages in fp32 (docs/ddp.md), and the digests would differ.
        ignored = ["2.weight", "2.bias"]
        DDP = torch.nn.parallel.DistributedDataParallel
        DDP._set_params_and_buffers_to_ignore_for_model(model, ignored)
        forward = DDP(model)
        state = commopt.ddp.OnebitHookState(opt, exchange_in_backward=True)
        forward.register_comm_hook(state, commopt.ddp.onebit_hook)
    h = hashlib.sha256()
    for t in range(1, STEPS + 1):
        gen = torch.Generator().manual_seed(100 * rank + t)
        x = torch.randn(16, 7, generator=gen)
        x[:, 3] = 0  # a dead input feature: its weights get zero gradient, hence zero variance
        out = forward(x)
        loss = ((out - torch.sin(x[:, :3])) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        if drop and rank == 1 and t % 3 == 0:
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
    parser.add_argument("--mode", choices=(*MODES, "all"), default="all")
    args = parser.parse_args(argv)
    options = {"step_guard": False} if args.step_guard == "off" else {}
    papers = args.step_guard == "off" or args.rules == "papers"
    paper_rules = {
        "ZeroOneAdam": {"bias_correction": False},
        "OnebitLamb": {"trust_ratio": "frozen"},
    }
    modes = list(MODES) if args.mode == "all" else [args.mode]
    for name in _OPTIMIZERS:
        extra = paper_rules.get(name, {}) if papers else {}
        for label in modes:
            mode, drop = MODES[label]
            args_ = (name, {**options, **extra}, mode, drop)
            print(name, " ".join(run_ranks(_digest, 4, *args_, timeout=300)), label)


if __name__ == "__main__":
    main()
