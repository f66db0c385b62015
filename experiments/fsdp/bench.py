"""How much memory and time does sharding with FSDP2 and replicating at one bit save?

Two measurements of the 25.2M-parameter WideMLP (experiments/tcp's model) under FSDP2, the
optimizer attached with :func:`commopt.fsdp.attach`:

``memory``: forks R × S gloo ranks for each S (R replicas fixed), trains two steps of 1-bit Adam
(the second compressed, so every exchange buffer exists) and sums, per rank, the bytes of the
storages behind the parameters, the gradients and the optimizer state (m, v and the exchange's
error buffers), deduplicated by storage: measured from the tensors that exist, not computed.

``speed``: one process per rank under a launcher (``netlab run``; experiments/fsdp/run.sh puts
2 ranks on each of 2 emulated hosts): the replicate dimension spans the hosts, the shard
dimension stays inside one. In one run, side by side: FSDP2's native HSDP (2-D mesh) with
``torch.optim.AdamW``, and FSDP2 over the shard dimension with commopt's 1-bit Adam attached,
in its compression stage and (``-warmup``) in its full-precision warmup. Median step time over
the timed steps, each step's time the slowest rank's, and its two parts (forward + backward,
where FSDP2 gathers and reduce-scatters inside the shard group and native HSDP all-reduces
across replicas; ``optimizer.step()``, where commopt averages or exchanges across replicas).

    python -m experiments.fsdp.bench memory --shards 1 2 4
    bash experiments/fsdp/run.sh 1gbit              # as root: speed on netlab
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import commopt
import commopt.fsdp
from experiments.harness.ranks import launch, run_ranks
from experiments.tcp.bench import WideMLP

__all__ = ["main", "measure_memory", "measure_speed"]


def _shard(model: nn.Module, mesh: Any, reshard: bool = True) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh)
    return model


def _mesh(replicas: int, shards: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))


def _nbytes(tensors: list[torch.Tensor]) -> int:
    storages = {}
    for t in tensors:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def _memory_rank(backend: Any, args: argparse.Namespace, replicas: int, shards: int) -> dict:
    del backend
    torch.manual_seed(0)
    mesh = _mesh(replicas, shards)
    model = _shard(WideMLP(args.width, args.hidden, args.depth), mesh["shard"])
    opt = commopt.OnebitAdam(model.parameters(), lr=1e-4, freeze_step=1)
    commopt.fsdp.attach(model, opt, mesh)
    x = torch.randn(args.batch, args.width)
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
    params = list(model.parameters())
    state = [t for s in opt.flat_states for t in (*s.flat.values(), *s.comm.values())]
    return {
        "params": _nbytes([p.to_local() for p in params]),
        "grads": _nbytes([p.grad.to_local() for p in params if p.grad is not None]),
        "state": _nbytes(state),
        "numel": sum(p.numel() for p in params),
    }


def measure_memory(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per-rank bytes at each shard count (the largest rank's)."""
    rows = []
    for shards in args.shards:
        ranks = run_ranks(
            _memory_rank, args.replicas * shards, args, args.replicas, shards, timeout=1200
        )
        rows.append({"shards": shards, **{k: max(r[k] for r in ranks) for k in ranks[0]}})
    return rows


def _memory_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    base = rows[0]
    lines = [
        f"WideMLP {args.width}→{args.hidden}(×{args.depth + 1})→{args.width}, "
        f"{base['numel']:,} parameters; 1-bit Adam, {args.replicas} replicas; per rank, the "
        f"largest rank's; {platform.processor() or platform.machine()}, torch {torch.__version__}",
        "",
        "| S (shards) | ranks | parameters MB | gradients MB | optimizer state MB | state × S / "
        f"state at S = {base['shards']} |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["state"] * r["shards"] / (base["state"] * base["shards"])
        lines.append(
            f"| {r['shards']} | {args.replicas * r['shards']} | {r['params'] / 1e6:.1f} | "
            f"{r['grads'] / 1e6:.1f} | {r['state'] / 1e6:.1f} | {ratio:.3f} |"
        )
    return "\n".join(lines)


def _speed_rank(args: argparse.Namespace) -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    shards = args.ranks_per_host
    replicas = world // shards
    results = {}
    for variant in args.variants.split(","):
        torch.manual_seed(0)
        mesh = _mesh(replicas, shards)
        model = WideMLP(args.width, args.hidden, args.depth)
        if variant == "HSDP-AdamW":  # FSDP2's own HSDP: all-reduce across replicas, fp32
            _shard(model, mesh)
            opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        elif variant in ("HSDP-OnebitAdam", "HSDP-OnebitAdam-warmup"):
            _shard(model, mesh["shard"])
            # (-warmup: every timed step is a full-precision one, averaged in step())
            freeze = 10**9 if variant.endswith("warmup") else args.warmup
            opt = commopt.OnebitAdam(model.parameters(), lr=1e-4, freeze_step=freeze)
            commopt.fsdp.attach(model, opt, mesh)
        else:
            raise ValueError(
                f"unknown variant {variant!r} (HSDP-AdamW, HSDP-OnebitAdam, HSDP-OnebitAdam-warmup)"
            )
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(args.batch, args.width, generator=gen)
        y = torch.randn(args.batch, args.width, generator=gen)
        times, backward, stepping = [], [], []
        for step in range(args.warmup + args.settle + args.measure):
            dist.barrier()
            start = time.perf_counter()
            nn.functional.mse_loss(model(x), y).backward()
            middle = time.perf_counter()
            opt.step()
            opt.zero_grad()
            end = time.perf_counter()
            elapsed = torch.tensor([end - start, middle - start, end - middle])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step >= args.warmup + args.settle:
                times.append(float(elapsed[0]))
                backward.append(float(elapsed[1]))
                stepping.append(float(elapsed[2]))
        results[variant] = {
            "median_ms": 1e3 * statistics.median(times),
            "forward_backward_ms": 1e3 * statistics.median(backward),
            "step_ms": 1e3 * statistics.median(stepping),
            "steps": len(times),
        }
    return {"world": world, "shards": shards, "replicas": replicas, "variants": results}


def _speed_table(result: dict[str, Any], args: argparse.Namespace) -> str:
    variants = result["variants"]
    base = variants.get("HSDP-AdamW", {}).get("median_ms")
    lines = [
        f"{args.label}; {result['replicas']} replicas × {result['shards']} shards (one replica "
        f"per host); WideMLP {args.width}→{args.hidden}(×{args.depth + 1})→{args.width}, batch "
        f"{args.batch}; median of {args.measure} steps after {args.warmup + args.settle}; "
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
        "",
        "| variant | step ms | forward+backward ms | optimizer.step() ms | speed-up vs "
        "HSDP-AdamW |",
        "|---|---|---|---|---|",
    ]
    for name, r in variants.items():
        ratio = f"{base / r['median_ms']:.2f}×" if base else "-"
        lines.append(
            f"| {name} | {r['median_ms']:.0f} | {r['forward_backward_ms']:.0f} | "
            f"{r['step_ms']:.0f} | {ratio} |"
        )
    return "\n".join(lines)


def measure_speed(args: argparse.Namespace) -> dict[str, Any] | None:
    """Step times under the launcher (rank 0's result; None elsewhere)."""
    return launch(_speed_rank, args.ranks_per_host * 2, args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("memory", "speed"))
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4], help="memory")
    parser.add_argument("--replicas", type=int, default=2, help="memory: R, fixed")
    parser.add_argument("--ranks-per-host", type=int, default=2, help="speed: S")
    parser.add_argument("--variants", default="HSDP-AdamW,HSDP-OnebitAdam,HSDP-OnebitAdam-warmup")
    parser.add_argument("--warmup", type=int, default=2, help="1-bit Adam's freeze step")
    parser.add_argument("--settle", type=int, default=2)
    parser.add_argument("--measure", type=int, default=8)
    parser.add_argument("--label", default="loopback")
    parser.add_argument("--out", help="write the table (markdown) and a .json beside it")
    args = parser.parse_args(argv)
    if args.what == "memory":
        rows = measure_memory(args)
        table, raw = _memory_table(rows, args), rows
    else:
        result = measure_speed(args)
        if result is None:
            return 0
        table, raw = _speed_table(result, args), result
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
        with open(args.out.rsplit(".", 1)[0] + ".json", "w") as f:
            json.dump(raw, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
