r"""Benchmark (not a test): hierarchical vs flat 1-bit allreduce vs dense fp32, in the same run.

For one buffer of ``--numel`` fp32 elements (default 16M = 64 MB) per rank, on a job of K nodes ×
L ranks, times these methods interleaved round by round (machine noise hits every one alike):

- ``flat-torch`` / ``flat-mpi``: :class:`commopt.exchange.FlatExchange` (SPEC §1) on the global
  gloo / MPI backend;
- ``hier-LOCAL-CROSS``: :class:`commopt.exchange.HierarchicalExchange` with its local level
  on LOCAL and its cross-node level on CROSS (``torch`` = gloo process groups from
  ``dist.new_group``; ``mpi`` = ``MPI.COMM_WORLD.Split``; under mpirun with the ``sm`` BTL, MPI
  moves the local level through shared memory; ``shm`` = :class:`~commopt.comm.shm_backend.
  SharedMemoryBackend`, one /dev/shm segment per node with the node's gloo group for barriers);
- a ``-pK`` suffix on ``flat-*`` or ``hier-*`` (``flat-torch-p1``, ``hier-shm-torch-p4``): the
  exchange built with ``pipeline=K`` (:mod:`commopt.pipelined`); without it, the default
  (``None``: 4 stages at 16M elements);
- ``fp32-torch`` / ``fp32-mpi``: a dense all_reduce of the fp32 buffer (what DDP sends);
- ``tiny-global`` / ``tiny-local``: one 16-byte gloo all-gather over all ranks / inside the node,
  the fixed cost α of one collective (latency and, on a loaded machine, scheduling).

Each call is bracketed by barriers; a call's time is the slowest rank's; the median over
``--reps`` rounds after ``--warmup`` is printed. Bytes: the modelled bytes of each level
(``CommStats``) and, on netlab, the bytes each host really sent on its link (``eth0`` counters
read by local rank 0: traffic between ranks of one host goes through loopback and is not
counted there).

Launch: ``bash experiments/hierarchical/netlab.sh 100mbit`` (as root; gloo only), or
``bash experiments/hierarchical/netlab.sh 100mbit --mpi`` (mpirun across the emulated hosts, MPI
methods available too).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import commopt
from commopt.comm import Backend, MpiBackend
from commopt.comm.shm_backend import SharedMemoryBackend
from commopt.compressed import compression_bytes
from commopt.exchange import FlatExchange, HierarchicalExchange
from commopt.exchange.levels import build_level_backends
from commopt.exchange.topology import discover_topology

__all__ = ["main"]

_TORCH_ONLY = "flat-torch,hier-torch-torch,hier-shm-torch,fp32-torch"
_ETH = "/sys/class/net/eth0/statistics/tx_bytes"


def _describe_machine() -> str:
    cpu = platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{cpu}, {os.cpu_count()} logical CPUs, load avg {load}; torch {torch.__version__}"


def _link_bytes() -> int:
    """Bytes this host has sent on its emulated link so far (0 when not on netlab)."""
    try:
        with open(_ETH) as f:
            return int(f.read())
    except OSError:
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=16 * 2**20, help="fp32 elements per rank")
    parser.add_argument("--reps", type=int, default=5, help="timed rounds (median reported)")
    parser.add_argument("--dense-reps", type=int, default=3, help="timed rounds of fp32-*")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--methods", default=_TORCH_ONLY, help="comma-separated, see the doc")
    parser.add_argument("--label", default="", help="free text printed with the results")
    parser.add_argument("--json", default="", help="also write the results here (rank 0)")
    args = parser.parse_args(argv)
    chosen = [m.strip() for m in args.methods.split(",") if m.strip()]

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    tb = commopt.init(timeout=900.0)
    rank, n = tb.rank, tb.world_size
    uses_mpi = any("mpi" in m for m in chosen)
    mb: Backend | None = MpiBackend() if uses_mpi else None
    topo = discover_topology(tb)
    if rank == 0:
        print(
            f"topology: {topo.num_nodes} nodes x {topo.local_size} ranks {topo.nodes} "
            f"(from {topo.source})",
            flush=True,
        )
    levels = {"torch": build_level_backends(tb, topo)}
    # Shared memory inside the node, the node's gloo group for barriers (never across).
    levels["shm"] = (SharedMemoryBackend(levels["torch"][0]), levels["torch"][1])
    if mb is not None:
        levels["mpi"] = build_level_backends(mb, topo)
    glob = {"torch": tb, "mpi": mb}

    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(args.numel, generator=gen)
    work = torch.empty_like(x)
    exchanges: dict[str, tuple[object, dict[str, torch.Tensor], list[Backend]]] = {}
    calls: dict[str, Callable[[], None]] = {}
    for m in chosen:
        kind, *engines = m.split("-")
        pipeline = None
        if kind in ("flat", "hier") and engines[-1][:1] == "p" and engines[-1][1:].isdigit():
            pipeline = int(engines.pop()[1:])
        if kind == "flat":
            ex = FlatExchange(glob[engines[0]], pipeline=pipeline)
            counted = [ex.backend]
        elif kind == "hier":
            local, cross = levels[engines[0]][0], levels[engines[1]][1]
            ex = HierarchicalExchange(
                glob[engines[1]], topo, local_backend=local, cross_backend=cross, pipeline=pipeline
            )
            counted = [cross, local]
        elif kind == "tiny":
            # One 16-byte all-gather: what a collective costs beyond its bytes (α of the model).
            be = glob["torch"] if engines[0] == "global" else levels["torch"][0]
            small, smalls = torch.zeros(2, dtype=torch.int64), torch.zeros(2 * n, dtype=torch.int64)
            calls[m] = lambda be=be, small=small, smalls=smalls: be.all_gather(
                smalls[: 2 * be.world_size], small
            )
            exchanges[m] = (None, {}, [be])
            continue
        elif kind == "fp32":
            be = glob[engines[0]]
            calls[m] = lambda be=be: be.all_reduce(work.copy_(x))
            exchanges[m] = (None, {}, [be])
            continue
        else:
            parser.error(f"unknown method {m!r}")
        state = {k: torch.zeros(v) for k, v in ex.state_numels(args.numel).items()}
        exchanges[m] = (ex, state, counted)
        calls[m] = lambda ex=ex, state=state: ex.allreduce_(work.copy_(x), state)

    times: dict[str, list[float]] = {m: [] for m in chosen}
    phases: dict[str, list[list[float]]] = {m: [] for m in chosen if m.startswith("hier")}
    link: dict[str, list[int]] = {m: [] for m in chosen}
    cpu_times: dict[str, list[float]] = {m: [] for m in chosen}
    modelled: dict[str, list[int]] = {m: [] for m in chosen}
    is_leader = topo.local_rank == 0
    for i in range(args.warmup + max(args.reps, args.dense_reps)):
        for m in chosen:
            reps = args.dense_reps if m.startswith("fp32") else args.reps
            if i >= args.warmup + reps:
                continue
            counted = exchanges[m][2]
            before = [b.stats.snapshot() for b in counted]
            dist.barrier()
            sent0 = _link_bytes() if is_leader else 0
            c0, t0 = time.process_time(), time.perf_counter()
            calls[m]()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            dist.barrier()
            sent = (_link_bytes() - sent0) if is_leader else 0
            stats = torch.tensor(
                [wall, sent, (counted[0].stats - before[0]).bytes_sent, cpu], dtype=torch.float64
            )
            peak = stats[:1].clone()
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            dist.all_reduce(stats)
            if m in phases:
                ph = torch.tensor(list(exchanges[m][0].phase_seconds.values()), dtype=torch.float64)
                dist.all_reduce(ph, op=dist.ReduceOp.MAX)
                if i >= args.warmup:
                    phases[m].append(ph.tolist())
            if i >= args.warmup:
                times[m].append(float(peak))
                cpu_times[m].append(float(stats[3]) / n)
                link[m].append(int(stats[1]) // topo.num_nodes)
                modelled[m].append(int(stats[2]) // n)

    if rank == 0:
        _report(args, topo, times, cpu_times, link, modelled, phases)
        for m, rows in phases.items():
            cols = zip(*rows, strict=True)
            parts = ", ".join(
                f"{name} {statistics.median(c) * 1e3:.1f}"
                for name, c in zip(("local reduce", "cross", "local gather"), cols, strict=True)
            )
            print(f"{m} phases (median ms, slowest rank per phase): {parts}")
    dist.barrier()
    return 0


def _report(args, topo, times, cpu_times, link, modelled, phases) -> None:
    K, L = topo.num_nodes, topo.local_size
    n = K * L
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"hierarchical bench {now:%Y-%m-%d %H:%M} UTC {args.label} on {socket.gethostname()}")
    print(f"machine: {_describe_machine()}")
    print(
        f"{K} nodes x {L} ranks, {args.numel:,} fp32 = {args.numel * 4 / 1e6:.1f} MB per rank; "
        f"median of {args.reps} ({args.dense_reps} for fp32) after {args.warmup} warm-up; "
        "each call timed on the slowest rank"
    )
    print(
        "| method | median ms | min ms | max ms | CPU ms/rank | host-link MB sent/host (eth0) "
        "| modelled MB/rank (global or cross level) |"
    )
    print("|---|---|---|---|---|---|---|")
    med = {m: statistics.median(v) for m, v in times.items()}
    for m, v in times.items():
        print(
            f"| {m} | {med[m] * 1e3:.1f} | {min(v) * 1e3:.1f} | {max(v) * 1e3:.1f} "
            f"| {statistics.median(cpu_times[m]) * 1e3:.1f} "
            f"| {statistics.median(link[m]) / 1e6:.2f} "
            f"| {statistics.median(modelled[m]) / 1e6:.3f} |"
        )
    flat_model = compression_bytes(args.numel, n)
    # Of the flat exchange's bytes, the share that leaves the node: peers on other nodes.
    print(
        f"model: flat sends {flat_model / 1e6:.3f} MB/rank, of which {(n - L) / (n - 1):.2f} "
        f"crosses hosts ({flat_model * (n - L) / (n - 1) * L / 1e6:.2f} MB/host); hierarchical "
        f"cross level {compression_bytes(args.numel // L, K) / 1e6:.3f} MB/rank "
        f"({compression_bytes(args.numel // L, K) * L / 1e6:.2f} MB/host)"
    )
    for h in [m for m in med if m.startswith("hier")]:
        for f in [m for m in med if m.startswith("flat") or m.startswith("fp32")]:
            ratio_link = (
                statistics.median(link[f]) / statistics.median(link[h])
                if statistics.median(link[h])
                else float("nan")
            )
            print(
                f"{h} vs {f}: {med[f] / med[h]:.2f}x faster, "
                f"{ratio_link:.2f}x fewer host-link bytes"
            )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "label": args.label,
                    "machine": _describe_machine(),
                    "nodes": K,
                    "local": L,
                    "numel": args.numel,
                    "times_s": times,
                    "cpu_s": cpu_times,
                    "phases_s": phases,
                    "link_bytes_per_host": link,
                    "modelled_bytes_per_rank": modelled,
                },
                fh,
                indent=1,
            )


if __name__ == "__main__":
    sys.exit(main())
