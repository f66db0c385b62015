"""``commopt tune``: measure every collective on every backend and write a selection table.

Run it like any other job, on the ranks and network you will train on::

    mpirun -n 4 commopt tune -o table.json                 # torch (gloo) and MPI
    torchrun --nproc-per-node 4 --no-python commopt tune  # torch only

For each operation (all_reduce in float32/float16/bfloat16, all_gather, all_to_all,
broadcast, and the compressed allreduce) and each size from ``--min-bytes`` to ``--max-bytes``
it times every backend (median of the slowest rank over ``--reps`` after ``--warmup``), picks
the fastest per size, merges neighbouring sizes with the same winner into ranges whose borders
lie at the geometric mean of the two measured sizes, and writes the table with every measured
time so the choice can be audited (schema: ``docs/mixed-backend.md``). Finally it builds a
:class:`~commopt.comm.MixedBackend` from the table and times the compressed allreduce through
it, which exercises the routing of its four sub-collectives.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from commopt.cli import _measure as m
from commopt.comm import Backend, MixedBackend
from commopt.comm.table import TABLE_FORMAT, TABLE_VERSION, SelectionTable, dtype_name

__all__ = ["HELP", "add_arguments", "build_rules", "main", "run"]

HELP = "measure collectives on every backend and write a MixedBackend selection table"
_REDUCE_DTYPES = ("float32", "float16", "bfloat16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``commopt tune`` options."""
    p.add_argument("-o", "--output", default="commopt_table.json", help="table to write (JSON)")
    m.add_sweep_arguments(p, default_factor=2)
    p.add_argument(
        "--reduce-dtypes",
        type=lambda s: m.parse_list(s, _REDUCE_DTYPES, "--reduce-dtypes"),
        default=list(_REDUCE_DTYPES),
        help="dtypes all_reduce is measured in (float32,float16,bfloat16)",
    )
    p.add_argument(
        "--tie",
        type=float,
        default=0.05,
        help="relative margin under which the previous size's winner is kept, to avoid "
        "flip-flopping on noise (0.05)",
    )


def _points(ops: Sequence[str], reduce_dtypes: Sequence[str]) -> list[tuple[str, torch.dtype]]:
    pts = []
    for op in ops:
        if op == "all_reduce":
            pts += [(op, getattr(torch, d)) for d in reduce_dtypes]
        else:
            pts.append((op, torch.float32))
    return pts


def _winners(times: Mapping[str, Sequence[float]], tie: float) -> list[str]:
    """The fastest backend at each size; within ``tie`` of it, the previous size's winner stays."""
    names = list(times)
    out: list[str] = []
    for i in range(len(times[names[0]])):
        best = min(names, key=lambda b: times[b][i])
        prev = out[-1] if out else None
        if prev is not None and prev != best and times[prev][i] <= times[best][i] * (1 + tie):
            best = prev
        out.append(best)
    return out


def build_rules(
    sizes: Sequence[int], winners: Sequence[str], op: str, dtype: str
) -> list[dict[str, Any]]:
    """Ranges tiling [0, ∞): measured size i is served by ``winners[i]``; a border between two
    measured sizes lies at their geometric mean; neighbours with the same winner merge.
    """
    rules: list[dict[str, Any]] = []
    for i, name in enumerate(winners):
        lo = 0 if i == 0 else math.isqrt(sizes[i - 1] * sizes[i])
        if rules and rules[-1]["backend"] == name:
            continue
        if rules:
            rules[-1]["max_bytes"] = lo
        rules.append(
            {"op": op, "dtype": dtype, "min_bytes": lo, "max_bytes": None, "backend": name}
        )
    return rules


def _versions(backends: Mapping[str, Backend]) -> dict[str, str]:
    import commopt

    v = {
        "commopt": commopt.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if "torch" in backends:
        v["torch_engine"] = str(getattr(backends["torch"], "engine", "?"))
    if "mpi" in backends:
        import mpi4py
        from mpi4py import MPI

        v["mpi4py"] = mpi4py.__version__
        v["mpi_library"] = MPI.Get_library_version().splitlines()[0].strip().rstrip("\x00")
    return v


def _hostnames(be: Backend) -> list[str]:
    name = socket.gethostname().encode()[:64].ljust(64, b"\0")
    mine = torch.frombuffer(bytearray(name), dtype=torch.uint8)
    everyone = torch.empty(64 * be.world_size, dtype=torch.uint8)
    be.all_gather(everyone, mine)
    raw = everyone.numpy().tobytes()
    return [
        raw[i * 64 : (i + 1) * 64].rstrip(b"\0").decode(errors="replace")
        for i in range(be.world_size)
    ]


def run(args: argparse.Namespace) -> int:
    """Measure the backends per operation and size and write the mixed backend's table."""
    backends = m.start_backends(args.backends)
    if not backends:
        return m.no_backend("tune")
    first = next(iter(backends.values()))
    rank, n = first.rank, first.world_size
    if args.reps < 1 or args.warmup < 0:
        raise ValueError(f"--reps must be >= 1 and --warmup >= 0, got {args.reps}, {args.warmup}")
    sizes = m.size_range(args.min_bytes, args.max_bytes, args.factor)
    points = _points(args.ops, args.reduce_dtypes)
    hosts = _hostnames(first)

    times: dict[str, dict[str, list[float]]] = {}
    actual: dict[str, list[int]] = {}
    bar = m.progress(len(points) * len(sizes) * len(backends), rank, not args.no_progress, "tune")
    for op, dtype in points:
        key = f"{op}/{dtype_name(dtype)}"
        times[key] = {b: [] for b in backends}
        actual[key] = []
        for size in sizes:
            case = m.make_case(op, size, dtype, n)
            actual[key].append(case.nbytes)
            for name, be in backends.items():  # interleaved, so drift hits every backend alike
                bar.set_postfix_str(f"{key} {m.human_bytes(size)} {name}")
                times[key][name].append(m.time_case(be, case, args.reps, args.warmup))
                bar.update()
            del case
    bar.close()

    rules: list[dict[str, Any]] = []
    wins: dict[str, int] = dict.fromkeys(backends, 0)
    for key, per_backend in times.items():
        op, dname = key.split("/")
        if op == "compressed_allreduce":
            continue  # not a backend operation: its sub-collectives are routed by their own rules
        winners = _winners(per_backend, args.tie)
        for w in winners:
            wins[w] += 1
        if op == "all_reduce":
            rules += build_rules(actual[key], winners, op, dname)
            if dname == "float32":  # other dtypes (int64 flags …) reduce natively like float32
                rules += build_rules(actual[key], winners, op, "*")
        else:
            rules += build_rules(actual[key], winners, op, "*")
    default = max(backends, key=lambda b: wins[b])  # first listed wins a tie

    table: dict[str, Any] = {
        "format": TABLE_FORMAT,
        "version": TABLE_VERSION,
        "world_size": n,
        "backends": list(backends),
        "default": default,
        "rules": rules,
        "measurements": {
            "statistic": "median over repetitions of the slowest rank's time per call, seconds",
            "repetitions": args.reps,
            "warmup": args.warmup,
            "tie_margin": args.tie,
            "sizes": {k: v for k, v in actual.items()},
            "times": times,
        },
        "created": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": hosts[0],
            "hosts": sorted(set(hosts)),
            "command": " ".join(["commopt", *sys.argv[1:]]),
            "versions": _versions(backends),
        },
    }
    SelectionTable(table, available=backends)  # fail here, not in the user's job

    key = "compressed_allreduce/float32"
    if key in times and len(backends) > 1:
        mixed = MixedBackend(backends, table)
        mixed_times = []
        for size in sizes:
            case = m.make_case("compressed_allreduce", size, torch.float32, n)
            mixed_times.append(m.time_case(mixed, case, args.reps, args.warmup))
        times[key]["mixed"] = mixed_times

    if rank == 0:
        tmp = f"{args.output}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(table, f, indent=1)
            f.write("\n")
        os.replace(tmp, args.output)
        print(summary(table))
        print(f"wrote {args.output}")
    first.barrier()
    return 0


def summary(table: Mapping[str, Any]) -> str:
    """Which backend serves which (op, dtype, size range), one line per range."""
    lines = [f"world size {table['world_size']}, default backend {table['default']!r}"]
    for r in table["rules"]:
        hi = "∞" if r["max_bytes"] is None else m.human_bytes(r["max_bytes"])
        lines.append(
            f"  {r['op']:<11} {r['dtype']:<9} [{m.human_bytes(r['min_bytes'])}, {hi}) "
            f"→ {r['backend']}"
        )
    ca = table["measurements"]["times"].get("compressed_allreduce/float32")
    if ca:
        sizes = table["measurements"]["sizes"]["compressed_allreduce/float32"]
        lines.append("  compressed_allreduce (ms): size " + " ".join(ca))
        for i, s in enumerate(sizes):
            cells = " ".join(f"{ca[b][i] * 1e3:9.3f}" for b in ca)
            lines.append(f"    {m.human_bytes(s):>8} {cells}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m commopt.cli.tune``."""
    p = argparse.ArgumentParser(prog="commopt tune", description=HELP)
    add_arguments(p)
    return run(p.parse_args(argv))
