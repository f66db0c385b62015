r"""How much optimizer state does a mostly frozen model cost? (docs/performance.md)

Adapters, LoRA and fine-tuning the last layers freeze most of a model: torch.optim creates a
parameter's state at its first gradient, so the frozen part costs nothing. This builds a stack
of ``--layers`` Linear layers, freezes the first ``--frozen`` fraction of its parameters
(``requires_grad=False``), takes ``--steps`` steps of each optimizer into its compression stage,
and prints the bytes of optimizer state held (every distinct storage reachable from
``optimizer.state``, and the per-rank error-feedback buffers of the buckets), next to
``torch.optim.Adam`` and to what the trained parameters alone occupy. One process.

    python -m experiments.optim.frozen_memory [--layers 20] [--width 512] [--frozen 0.9]
"""

from __future__ import annotations

import argparse

import torch

import commopt
from experiments.harness.training import describe_machine

__all__ = ["main", "state_bytes"]


def state_bytes(opt: torch.optim.Optimizer) -> tuple[int, int]:
    """(bytes of every distinct storage in ``opt.state``, bytes of the buckets' error buffers)."""
    seen: dict[int, int] = {}
    for entry in opt.state.values():
        for value in entry.values():
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    errors = 0
    for state in getattr(opt, "flat_states", []):
        errors += sum(buf.numel() * buf.element_size() for buf in state.comm.values())
    return sum(seen.values()), errors


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--frozen", type=float, default=0.9)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    commopt.init(backend="torch")  # one process: a world of one
    print(describe_machine())
    rows = []
    for name in ("Adam", "OnebitAdam", "OnebitLamb", "ZeroOneAdam"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            *[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
        )
        params = list(model.parameters())
        total = sum(p.numel() for p in params)
        frozen = 0
        for p in params:  # the first --frozen fraction of the parameters, in model order
            if frozen + p.numel() <= args.frozen * total:
                p.requires_grad_(False)
                frozen += p.numel()
        if name == "Adam":
            opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=1e-3)
        elif name == "ZeroOneAdam":
            opt = commopt.ZeroOneAdam(params, lr=1e-3, var_freeze_step=2)
        else:
            opt = getattr(commopt, name)(params, lr=1e-3, freeze_step=2)
        for _ in range(args.steps):
            opt.zero_grad()
            model(torch.randn(8, args.width)).square().mean().backward()
            opt.step()
        state, errors = state_bytes(opt)
        trained = (total - frozen) * 4
        rows.append((name, total, frozen, state, errors, trained))
    print(
        f"\n{args.layers} x Linear({args.width}, {args.width}), first "
        f"{args.frozen:.0%} of the parameters frozen, {args.steps} steps\n"
    )
    print(
        "| optimizer | parameters | frozen | state MB | error buffers MB | state / trained fp32 |"
    )
    print("|---|---|---|---|---|---|")
    for name, total, frozen, state, errors, trained in rows:
        print(
            f"| {name} | {total:,} | {frozen:,} | {state / 2**20:.2f} | {errors / 2**20:.2f} | "
            f"{state / trained:.2f}x |"
        )


if __name__ == "__main__":
    main()
