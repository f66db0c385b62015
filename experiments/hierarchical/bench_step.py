r"""Benchmark (not a test): 1-bit Adam's compression-stage step, flat vs hierarchical, same run.

Every rank holds an MLP's parameters (io → width → width → io, weights and biases; 8,392,704
parameters at the defaults 1024/2048) with fixed random gradients of its own. For each variant —
``OnebitAdam(..., topology="flat")``, ``OnebitAdam(..., topology="hierarchical")`` (as a user
gets it: on gloo the local level is on shared memory, ``shared_memory="auto"``),
``hierarchical-gloo`` (the same with the local level on the node's gloo group,
``COMMOPT_SHARED_MEMORY=0``), ``auto`` (``topology="auto"``) and ``torch.optim.Adam`` after one
fp32 all_reduce of the gradients (what DDP sends) — the step is
run past the warmup (``freeze_step=1``), then ``--steps`` timed steps per round, variants
interleaved round by round. Reported: the median step time (slowest rank), CPU per rank, and
the bytes each host sent on its emulated link (eth0 counters, netlab only).

Launch: ``bash experiments/hierarchical/netlab.sh 100mbit`` runs bench.py; for this one use
``BENCH=experiments/hierarchical/bench_step.py bash experiments/hierarchical/netlab.sh 100mbit``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import commopt
from commopt.exchange.topology import discover_topology

__all__ = ["main"]

_ETH = "/sys/class/net/eth0/statistics/tx_bytes"


def _link_bytes() -> int:
    try:
        with open(_ETH) as f:
            return int(f.read())
    except OSError:
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--io", type=int, default=1024)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="flat,hierarchical,hierarchical-gloo,adam-fp32")
    parser.add_argument("--label", default="")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    backend = commopt.init(timeout=900.0)
    rank, n = backend.rank, backend.world_size
    topo = discover_topology(backend)
    shapes = [
        (args.width, args.io), (args.width,), (args.width, args.width), (args.width,),
        (args.io, args.width), (args.io,),
    ]  # fmt: skip
    numel = sum(torch.Size(s).numel() for s in shapes)
    gen = torch.Generator().manual_seed(rank)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    setups = {}
    for v in variants:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s) * 0.01) for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        if v == "adam-fp32":
            opt = torch.optim.Adam(params, lr=1e-6)
        elif v == "hierarchical-gloo":
            opt = commopt.OnebitAdam(params, lr=1e-6, freeze_step=1, topology="hierarchical")
        else:
            opt = commopt.OnebitAdam(params, lr=1e-6, freeze_step=1, topology=v)
        setups[v] = (opt, params)

    def step(v: str) -> None:
        opt, params = setups[v]
        if v == "adam-fp32":
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            flat.div_(n)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        opt.step()

    for v in variants:  # past the warmup (freeze_step=1) into the compression stage
        # The exchange is built on first use, in these steps.
        setting = os.environ.get("COMMOPT_SHARED_MEMORY")
        if v == "hierarchical-gloo":
            os.environ["COMMOPT_SHARED_MEMORY"] = "0"
        try:
            for _ in range(2):
                step(v)
        finally:
            if setting is None:
                os.environ.pop("COMMOPT_SHARED_MEMORY", None)
            else:
                os.environ["COMMOPT_SHARED_MEMORY"] = setting
        exchange = getattr(setups[v][0], "_exchange", None)
        if rank == 0:
            print(f"{v}: {exchange!r}", flush=True)
    times = {v: [] for v in variants}
    cpus = {v: [] for v in variants}
    link = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            for _ in range(args.steps):
                dist.barrier()
                b0 = _link_bytes() if topo.local_rank == 0 else 0
                c0, t0 = time.process_time(), time.perf_counter()
                step(v)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                dist.barrier()
                sent = (_link_bytes() - b0) if topo.local_rank == 0 else 0
                t = torch.tensor([wall, cpu, sent], dtype=torch.float64)
                peak = t[:1].clone()
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                dist.all_reduce(t)
                times[v].append(float(peak))
                cpus[v].append(float(t[1]) / n)
                link[v].append(float(t[2]) / topo.num_nodes)
    if rank == 0:
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
        print(
            f"1-bit Adam compression-stage step, {args.label}; {topo.num_nodes} nodes x "
            f"{topo.local_size} ranks; MLP {numel:,} parameters; median of "
            f"{args.rounds}x{args.steps} steps; load avg {load}"
        )
        print("| variant | median ms/step | min | max | CPU ms/rank | host-link MB/host/step |")
        print("|---|---|---|---|---|---|")
        for v in variants:
            print(
                f"| {v} | {statistics.median(times[v]) * 1e3:.1f} | {min(times[v]) * 1e3:.1f} "
                f"| {max(times[v]) * 1e3:.1f} | {statistics.median(cpus[v]) * 1e3:.1f} "
                f"| {statistics.median(link[v]) / 1e6:.2f} |"
            )
        for hv in [v for v in variants if v.startswith("hierarchical") or v == "auto"]:
            if "flat" not in times:
                break
            f, h = statistics.median(times["flat"]), statistics.median(times[hv])
            lf, lh = statistics.median(link["flat"]), statistics.median(link[hv])
            print(
                f"{hv} vs flat: {f / h:.2f}x faster, "
                f"{lf / lh if lh else float('nan'):.2f}x fewer host-link bytes"
            )
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
