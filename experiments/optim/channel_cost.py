"""What overlap's own communicator costs: the process group an overlapping optimizer opens when
it is built (docs/overlap.md, "channels").

    python -m experiments.optim.channel_cost

Forked gloo ranks on loopback, 2 and then 4 of them. Each rank times ``dist.new_group()`` (what
``overlap=True`` adds to building an optimizer) and reads its resident memory before the call
and after the group's first all-reduce of one element (gloo connects lazily). Printed per world
size, over 3 groups: the slowest rank's median ms and the largest RSS growth in MB.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import commopt
from experiments.harness import describe_machine, run_ranks


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def run(backend: commopt.Backend) -> tuple[float, float]:
    del backend  # the harness's default group is the one new groups are carved from
    times, growth = [], []
    for _ in range(3):
        before = _rss_mb()
        t = time.perf_counter()
        group = dist.new_group()
        times.append(time.perf_counter() - t)
        dist.all_reduce(torch.ones(1), group=group)
        growth.append(_rss_mb() - before)
    return 1e3 * statistics.median(times), max(growth)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes")
    args = parser.parse_args(argv)
    print(f"# dist.new_group() on forked gloo ranks, loopback; {describe_machine()}")
    for n in args.ranks:
        per_rank = run_ranks(run, n, timeout=300)
        ms = max(r[0] for r in per_rank)
        mb = max(r[1] for r in per_rank)
        print(f"{n} ranks: new_group {ms:.1f} ms (slowest rank, median of 3), RSS +{mb:.1f} MB")


if __name__ == "__main__":
    main()
