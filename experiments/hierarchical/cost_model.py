r"""A cost model of the flat and the hierarchical 1-bit allreduce (docs/performance.md, last part).

For K nodes × L ranks (n = K·L), N elements per rank, per call:

    T = W / B  +  m · α  +  C  (+ V / B_loc for the fp32 reduce-scatter inside a node)

- W: bytes a node sends over its link (each direction; full duplex), B: the link's payload rate.
  Flat, direct exchange: W = 2·(K−1)/K · L · N/8; with gloo's ring all-gather the all-gather half
  is (n−1)/n · N/8 per node instead. Hierarchical: W = 2·(K−1)/K · N/8 (L times less).
- m: collectives in sequence (flat 4: scales+length, signs all-to-all, server signs, server
  scales; hierarchical 7: inside the node the agreement gather, the safe? gather, the
  reduce-scatter and the gather of the 1-bit result, across it scales+agreement, signs
  all-to-all, server signs+scale),
  α: what one costs beyond its bytes (latency, synchronisation; on a loaded machine the wait for
  every participant to be scheduled). For many ranks the ring steps count: flat 4·(n−1)·α,
  hierarchical 3·(K−1)·α across and 4·(L−1)·α_loc inside.
- C: CPU (or GPU) time of the per-element work; V = (L−1)/L · 4N bytes moved by the local level.

``python experiments/hierarchical/cost_model.py [--validate run.json ...]`` prints the
extrapolation table, and with JSON files from bench.py fits α per run on the flat exchange and
predicts the run's hierarchical variants from it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

__all__ = ["extrapolate", "flat_time", "hier_time", "main"]

TCP_EFFICIENCY = 0.955  # payload / line rate (iperf3 over a netlab 1gbit link: 955 Mbit/s)


def flat_time(N, K, L, B, alpha, c_flat, ring_gather=False):
    """Seconds for the flat exchange (SPEC §1 over n = K·L ranks)."""
    n = K * L
    a2a = L * (K - 1) / K * N / 8
    gather = (n - 1) / n * N / 8 if ring_gather else L * (K - 1) / K * N / 8
    return (a2a + gather) / B + alpha + c_flat * N


def hier_time(N, K, L, B, alpha, c_hier, B_loc=float("inf")):
    """Seconds for the hierarchical exchange: local fp32 reduce-scatter, SPEC §1 on N/L across."""
    wire = 2 * (K - 1) / K * N / 8
    local = (L - 1) / L * 4 * N / B_loc
    return wire / B + local + alpha + c_hier * N


def dense_time(N, n, B, alpha, bytes_per_element=4):
    """A ring allreduce (DDP): every node's link carries 2·(n−1)/n of the buffer."""
    return 2 * (n - 1) / n * bytes_per_element * N / B + 2 * (n - 1) * alpha


def extrapolate(N=350e6, K=32, L=8, gbits=(10, 25), alpha_net=30e-6, alpha_loc=5e-6):
    """The paper table: per-call times (s) for DDP fp32/fp16, flat and hierarchical 1-bit."""
    rows = []
    n = K * L
    for g in gbits:
        B = g * 1e9 / 8 * TCP_EFFICIENCY
        # GPU per-element work: SPEC §1 touches ~20 bytes per element at ~1.5 TB/s; the
        # hierarchical rank compresses N/L and sums/unpacks N (~12 bytes per element).
        c_flat = 20 / 1.5e12
        c_hier = 20 / 1.5e12 / L + 12 / 1.5e12
        B_loc = 150e9  # NCCL reduce-scatter bus bandwidth over NVLink, 8 GPUs
        t32 = dense_time(N, n, B, alpha_net)
        t16 = dense_time(N, n, B, alpha_net, 2)
        tf = flat_time(N, K, L, B, 4 * (n - 1) * alpha_net, c_flat, ring_gather=True)
        th = hier_time(N, K, L, B, 3 * (K - 1) * alpha_net + 4 * (L - 1) * alpha_loc, c_hier, B_loc)
        rows.append((g, K, L, t32, t16, tf, th))
    return rows


# Collectives in sequence per call: (spanning nodes, inside a node, is the local level gloo).
# A gloo collective inside a node goes through TCP loopback and costs what any gloo collective
# costs (α); a shared-memory one (SharedMemoryBackend: one barrier; MPI sm) costs what a lone
# small collective inside the node costs (tiny-local, measured in the same run).
_SYNCS = {
    "flat-torch": (4, 0, True),
    "hier-torch-torch": (3, 3, True),
    "hier-shm-torch": (3, 3, False),
    "hier-mpi-torch": (3, 3, False),
}


def _validate(paths: list[str]) -> None:
    runs = []
    for p in paths:
        with open(p) as f:
            r = json.load(f)
        rate = 1e8 if "100mbit" in r["label"] else 1e9
        med = {m: statistics.median(v) for m, v in r["times_s"].items()}
        tiny_local = med.get("tiny-local", 0.0)
        for m, t in med.items():
            if m not in _SYNCS:
                continue  # dense and tiny are not modelled here
            launch = "mpirun" if "mpirun" in r["label"] else "netlab run"
            runs.append(
                {
                    "run": f"{launch} {rate / 1e6:.0f} Mbit/s ({p.rsplit('/', 1)[-1]})",
                    "method": m,
                    "B": rate / 8 * TCP_EFFICIENCY,
                    "T": t,
                    "cpu": statistics.median(r["cpu_s"][m]),
                    "W": statistics.median(r["link_bytes_per_host"][m]),
                    "m": _SYNCS[m][0] + (_SYNCS[m][1] if _SYNCS[m][2] else 0),
                    "local": 0.0 if _SYNCS[m][2] else _SYNCS[m][1] * tiny_local,
                    "tiny": med.get("tiny-global"),
                }
            )
    # α (the load-dependent part) is fitted per run on its flat exchange, then predicts the
    # hierarchical variants of the same run.
    alphas = {}
    for x in runs:
        if x["method"] == "flat-torch":
            alphas[x["run"]] = (x["T"] - x["W"] / x["B"] - x["cpu"]) / x["m"]
    for run, a in alphas.items():
        tiny = next(x["tiny"] for x in runs if x["run"] == run)
        lone = f"; a lone 16-byte all-gather {tiny * 1e3:.1f} ms" if tiny else ""
        print(f"α fitted on flat-torch, {run}: {a * 1e3:.1f} ms per collective{lone}")
    print(
        "| run | method | W MB/host | W/B ms | CPU ms | syncs·α ms | predicted ms | measured ms "
        "| error |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for x in runs:
        alpha = alphas[x["run"]]
        pred = x["W"] / x["B"] + x["cpu"] + x["m"] * alpha + x["local"]
        print(
            f"| {x['run']} | {x['method']} | {x['W'] / 1e6:.2f} | {x['W'] / x['B'] * 1e3:.0f} "
            f"| {x['cpu'] * 1e3:.0f} | {(x['m'] * alpha + x['local']) * 1e3:.0f} "
            f"| {pred * 1e3:.0f} "
            f"| {x['T'] * 1e3:.0f} | {(pred - x['T']) / x['T'] * 100:+.0f} % |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--validate", nargs="*", default=[], help="bench.py JSON files")
    parser.add_argument("--numel", type=float, default=350e6, help="elements per call")
    args = parser.parse_args(argv)
    if args.validate:
        _validate(args.validate)
        print()
    print(f"extrapolation, N = {args.numel / 1e6:.0f}M elements per call (seconds per call)")
    print(
        "| link | nodes × ranks | DDP fp32 | DDP fp16 | flat 1-bit | hierarchical 1-bit "
        "| hier ÷ flat | speed-up vs fp32 | vs fp16 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for L in (8, 4, 2):
        for g, K, L_, t32, t16, tf, th in extrapolate(args.numel, L=L):
            print(
                f"| {g} Gbit/s | {K} × {L_} | {t32:.3f} | {t16:.3f} | {tf:.3f} | {th:.3f} "
                f"| {tf / th:.1f}× | {t32 / th:.1f}× (flat {t32 / tf:.1f}×) "
                f"| {t16 / th:.1f}× (flat {t16 / tf:.1f}×) |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
