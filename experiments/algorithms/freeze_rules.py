r"""Candidate automatic freeze rules, replayed on traces and (optionally) run for real.

    python -m experiments.algorithms.freeze_rules                      # replay: rule × task × seed
    python -m experiments.algorithms.freeze_rules --run snr-anchor --task digits --seeds 0,1,2,3,4
    python -m experiments.algorithms.freeze_rules --run snr-anchor --task lm --seeds 0,1,2
    python -m experiments.algorithms.freeze_rules --run snr-anchor --task digits --seeds 0,1,2,3,4 \
        --steps 600 --sweep 300,450,600                            # the run-length check
    python -m experiments.algorithms.freeze_rules --make-traces RAW_DIR [--traces FILE]
        # compact RAW_DIR/trace_<task>_seed<S>.json (freeze_trace --variants adam [--steps N])
        # into FILE (default: the committed freeze_traces.json), then replay it

Replay writes ``freeze_rules_replay.md`` (``<FILE stem>_replay.md`` for another traces file),
real runs ``freeze_rule_<rule>_<task>[_<N>steps].{md,json}``, into ``--out`` (default
experiments/algorithms/results).

Question: can a rule computed only from quantities every rank holds alike during the
warmup (the Adam state m, v of the *averaged* gradient and the step count: no message) freeze
1-bit Adam's variance late enough on digits (v falls 2–3× from its peak at step ~45 to step 300,
and a fixed freeze at 175–250 is best there) and still at ~90–150 on the LM (where v settles
and F = 120 is best)? docs/algorithms/auto_freeze.md ("Other rules tried") has the answer.

**Replay.** ``freeze_traces.json`` (in experiments/algorithms/results) holds, per task and seed, the
Adam reference's per-step
    x_t = (1/K) Σ_k ln mean(√v̂_k)             (today's statistic, from a float64 shadow v)
    q_t = (1/K) Σ_k mean(m̂_k²) / mean(v̂_k)    (the signal share of the gradient)
recorded by ``experiments.algorithms.freeze_trace --variants adam`` (the warmup is that Adam, and
it does not depend on the freeze step, so a rule's decision on the trace is its decision in a
run). Each rule below is a stand-alone object with ``observe(step, x, q) -> bool`` (True from
the step it froze on); ``replay`` feeds it a trace. Target bands: digits 175–299 (a denser fixed
sweep, five seeds, put F = 175, 200, 250 within noise of each other and 90–150 5–10 % worse),
LM 90–150 (F = 120 best, F = 200 +1.2 %, F = 60 +0.3 %).

**Real runs** (``--run RULE``): OnebitAdam(freeze_step="auto") with the rule injected in place
of today's (a subclass that overrides ``_observe_variance``: the rule sees the level the
optimizer computes, and reads m and v from its buckets for q), against fixed F = 120 and
F = 200 on the same seeds; final validation loss, freeze step and MB sent per rank.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import time
from typing import Any

import commopt
from commopt.optim.freeze import VarianceLevel
from experiments.algorithms.common import run_variants
from experiments.convergence.run import DEFAULTS
from experiments.harness.training import describe_machine

RESULTS = pathlib.Path(__file__).parent / "results"
TRACES = RESULTS / "freeze_traces.json"
BANDS = {"digits": (175, 299), "lm": (90, 150)}
BETA1 = 0.9


# -- the rules -------------------------------------------------------------------------------
class Rule:
    """Base: keeps the observations (replay only: O(t) memory, no monotone queues)."""

    min_step = 40
    fraction = 0.5  # the window's share of the steps so far (today's f)

    def __init__(self) -> None:
        self.xs: list[tuple[int, float]] = []
        self.frozen_at: int | None = None

    def window(self, t: int) -> list[tuple[int, float]]:
        """Observations in [t − ⌊f·t⌋, t] (today's window at f = 1/2), or [] if not yet
        covered."""
        start = t - math.floor(self.fraction * t)
        if not self.xs or self.xs[0][0] > start:
            return []
        return [(s, x) for s, x in self.xs if s >= start]

    def observe(self, t: int, x: float, q: float) -> bool:
        if self.frozen_at is not None:
            return True
        self.xs.append((t, x))
        self.see(t, x, q)
        if t >= self.min_step and self.decide(t):
            self.frozen_at = t
            return True
        return False

    def see(self, t: int, x: float, q: float) -> None:  # extra statistics (signal share)
        del t, x, q

    def decide(self, t: int) -> bool:
        raise NotImplementedError


def log_range(w: list[tuple[int, float]]) -> float:
    """max − min of x over the window (today's R_t)."""
    return max(x for _, x in w) - min(x for _, x in w) if w else math.inf


def largest_rise(w: list[tuple[int, float]]) -> float:
    """max over s < s' in the window of x_s' − x_s: how far the level *rose* inside the window
    (a peak or a climb counts, a decline does not)."""
    if not w:
        return math.inf
    low, rise = math.inf, 0.0
    for _, x in w:
        low = min(low, x)
        rise = max(rise, x - low)
    return rise


def slope(w: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares slope b of x over the window (per step) and the residual standard
    deviation around the fitted line."""
    n = len(w)
    ms = sum(s for s, _ in w) / n
    mx = sum(x for _, x in w) / n
    sxx = sum((s - ms) ** 2 for s, _ in w)
    b = sum((s - ms) * (x - mx) for s, x in w) / sxx
    res = [x - mx - b * (s - ms) for s, x in w]
    return b, math.sqrt(sum(r * r for r in res) / max(1, n - 2))


class LogRange(Rule):
    """Today's rule: R_t ≤ τ (commopt.optim.freeze.AutoFreeze)."""

    def __init__(self, tau: float = 0.05, fraction: float = 0.5) -> None:
        super().__init__()
        self.tau, self.fraction = tau, fraction

    def decide(self, t: int) -> bool:
        return log_range(self.window(t)) <= self.tau


class RelaxedRange(Rule):
    """The drift rule relaxed over time: R_t ≤ τ·(t/40)^α."""

    def __init__(self, tau: float = 0.05, alpha: float = 1.0) -> None:
        super().__init__()
        self.tau, self.alpha = tau, alpha

    def decide(self, t: int) -> bool:
        return log_range(self.window(t)) <= self.tau * (t / 40) ** self.alpha


class Rate(Rule):
    """A rate rule, scale-free: |b|·t ≤ κ (b the window's fitted slope of x per step, so b·t is
    the change of x per e-fold of the step count); ``decline`` accepts any fall (b < 0) as long
    as the level did not rise by more than τ inside the window."""

    def __init__(self, kappa: float = 0.1, decline: bool = False, tau: float = 0.05) -> None:
        super().__init__()
        self.kappa, self.decline, self.tau = kappa, decline, tau

    def decide(self, t: int) -> bool:
        w = self.window(t)
        if len(w) < 3:
            return False
        b, _ = slope(w)
        if self.decline and b < 0:
            return largest_rise(w) <= self.tau
        return abs(b) * t <= self.kappa


class DriftToNoise(Rule):
    """v's drift against its noise: the fitted change over the window |b|·(t/2) is at most
    c times the residual standard deviation (no trend that stands out of the noise)."""

    def __init__(self, c: float = 2.0) -> None:
        super().__init__()
        self.c = c

    def decide(self, t: int) -> bool:
        w = self.window(t)
        if len(w) < 3:
            return False
        b, sd = slope(w)
        return abs(b) * (t // 2) <= self.c * sd


class DeclineOk(Rule):
    """A steady decline is tolerated, a peak or a rise is not: largest rise in window ≤ τ."""

    def __init__(self, tau: float = 0.05) -> None:
        super().__init__()
        self.tau = tau

    def decide(self, t: int) -> bool:
        return largest_rise(self.window(t)) <= self.tau


def noise_floor(beta1: float = BETA1) -> float:
    """The signal share q of a pure-noise gradient: mean m̂² / mean v̂ → (1 − β1)/(1 + β1)
    (the EMA of independent zero-mean terms; 0.053 at β1 = 0.9)."""
    return (1 - beta1) / (1 + beta1)


class SignalShare(Rule):
    """Freeze when the signal share q_t ≤ k·floor (the gradient has become noise)."""

    def __init__(self, k: float = 2.0) -> None:
        super().__init__()
        self.k = k
        self.q = math.inf

    def see(self, t: int, x: float, q: float) -> None:
        self.q = q

    def decide(self, t: int) -> bool:
        return self.q <= self.k * noise_floor()


class SignalAnchor(Rule):
    """Anchored on the end of the signal-dominated phase (the best rule found).

    t_n = the first step with q_t ≤ k·(1 − β1)/(1 + β1) (k = 2: q ≤ 0.105 at β1 = 0.9, twice
    the share of a pure-noise gradient); freeze at the first t ≥ max(min_step, c·t_n) at which
    the level is not raised: with ``guard="low"`` x_t − min x_s ≤ τ over the window
    [t − ⌊t/2⌋, t] (one running minimum, the state today's rule already keeps); with
    ``guard="rise"`` the largest rise inside the window, max_{s<s'} x_s' − x_s, ≤ τ. A steady
    decline passes both, a level still above its recent low waits. ``range_too``: also freeze
    whenever today's R_t ≤ τ; ``fallback``: today's R_t ≤ τ also freezes while t_n is not yet
    known (a gradient that never becomes noise-dominated)."""

    def __init__(
        self,
        c: float = 6.0,
        k: float = 2.0,
        tau: float = 0.05,
        guard: str = "low",
        range_too: bool = False,
        fallback: bool = False,
    ) -> None:
        super().__init__()
        self.c, self.k, self.tau, self.guard = c, k, tau, guard
        self.range_too, self.fallback = range_too, fallback
        self.t_n: int | None = None

    def see(self, t: int, x: float, q: float) -> None:
        if self.t_n is None and q <= self.k * noise_floor():
            self.t_n = t

    def decide(self, t: int) -> bool:
        w = self.window(t)
        if (self.range_too or (self.fallback and self.t_n is None)) and log_range(w) <= self.tau:
            return True
        if self.t_n is None or t < self.c * self.t_n or not w:
            return False
        if self.guard == "rise":
            return largest_rise(w) <= self.tau
        return w[-1][1] - min(x for _, x in w) <= self.tau


def signal_anchor_step(
    xs: list[float],
    qs: list[float],
    beta1: float = BETA1,
    c: float = 6.0,
    k: float = 2.0,
    tau: float = 0.05,
    min_step: int = 40,
) -> int | None:
    """The signal-anchor rule as one function (for porting): the freeze step chosen on the
    per-step statistics ``xs[t-1]`` = x_t = (1/K) Σ_k ln mean(√v̂_k) and ``qs[t-1]`` =
    q_t = (1/K) Σ_k mean(m̂_k²)/mean(v̂_k) (m̂, v̂ bias-corrected), or None.

        t_n = min{t : q_t ≤ k·(1 − β1)/(1 + β1)}
        freeze at min{t ≥ max(min_step, c·t_n) : x_t − min_{t − ⌊t/2⌋ ≤ s ≤ t} x_s ≤ τ}
    """
    floor = k * (1 - beta1) / (1 + beta1)
    t_n = None
    for t in range(1, len(xs) + 1):
        if t_n is None and qs[t - 1] <= floor:
            t_n = t
        if t_n is None or t < max(min_step, c * t_n):
            continue
        if xs[t - 1] - min(xs[t - 1 - t // 2 : t]) <= tau:
            return t
    return None


class PeakAnchor(Rule):
    """Anchored on the level's peak: freeze at t ≥ c·argmax_{s ≤ t} x_s with no rise > τ in the
    window (on the LM x is highest at steps 3–4, so this fires at min_step there)."""

    def __init__(self, c: float = 4.5, tau: float = 0.05) -> None:
        super().__init__()
        self.c, self.tau = c, tau

    def decide(self, t: int) -> bool:
        peak = max(self.xs, key=lambda e: e[1])[0]
        return t >= self.c * peak and largest_rise(self.window(t)) <= self.tau


RULES: dict[str, Any] = {
    "log-range τ=0.05 (today)": lambda: LogRange(0.05),
    "log-range f=0.4, τ=0.05": lambda: LogRange(0.05, fraction=0.4),
    "log-range f=0.6, τ=0.05": lambda: LogRange(0.05, fraction=0.6),
    "log-range τ=0.04": lambda: LogRange(0.04),
    "log-range τ=0.06": lambda: LogRange(0.06),
    "log-range τ=0.07": lambda: LogRange(0.07),
    "relaxed τ=0.05·(t/40)^0.5": lambda: RelaxedRange(0.05, 0.5),
    "relaxed τ=0.05·(t/40)^1": lambda: RelaxedRange(0.05, 1.0),
    "relaxed τ=0.05·(t/40)^2": lambda: RelaxedRange(0.05, 2.0),
    "rate t·abs(b) ≤ 0.1": lambda: Rate(0.1),
    "rate t·abs(b) ≤ 0.2": lambda: Rate(0.2),
    "rate t·abs(b) ≤ 0.4": lambda: Rate(0.4),
    "rate ≤ 0.1, any decline w/o rise": lambda: Rate(0.1, decline=True),
    "drift ≤ 2·noise": lambda: DriftToNoise(2.0),
    "drift ≤ 4·noise": lambda: DriftToNoise(4.0),
    "decline ok: rise ≤ 0.05": lambda: DeclineOk(0.05),
    "decline ok: rise ≤ 0.02": lambda: DeclineOk(0.02),
    "signal share q ≤ 2·floor": lambda: SignalShare(2.0),
    "signal share q ≤ 1·floor": lambda: SignalShare(1.0),
    "peak anchor 4.5·t_peak": lambda: PeakAnchor(4.5),
    "signal anchor 4·t_n": lambda: SignalAnchor(4.0),
    "signal anchor 5·t_n": lambda: SignalAnchor(5.0),
    "signal anchor 6·t_n": lambda: SignalAnchor(6.0),
    "signal anchor 7·t_n": lambda: SignalAnchor(7.0),
    "signal anchor 5.5·t_n": lambda: SignalAnchor(5.5),
    "signal anchor 6.5·t_n": lambda: SignalAnchor(6.5),
    "signal anchor 6·t_n, q ≤ 1·floor": lambda: SignalAnchor(6.0, k=1.0),
    "signal anchor 6·t_n, q ≤ 1.5·floor": lambda: SignalAnchor(6.0, k=1.5),
    "signal anchor 6·t_n, q ≤ 3·floor": lambda: SignalAnchor(6.0, k=3.0),
    "signal anchor 6·t_n, x_t − low ≤ 0.02": lambda: SignalAnchor(6.0, tau=0.02),
    "signal anchor 6·t_n, guard rise ≤ 0.05": lambda: SignalAnchor(6.0, guard="rise"),
    "signal anchor 6·t_n, guard rise ≤ 0.02": lambda: SignalAnchor(6.0, tau=0.02, guard="rise"),
    "signal anchor 6·t_n + range fallback": lambda: SignalAnchor(6.0, fallback=True),
    "signal anchor 6·t_n or range": lambda: SignalAnchor(6.0, range_too=True),
}
RUNNABLE = {
    "snr-anchor": (
        "signal anchor 6·t_n, guard rise ≤ 0.05",
        lambda: SignalAnchor(6.0, guard="rise"),
    ),
    "decline-ok": ("decline ok: rise ≤ 0.05", lambda: DeclineOk(0.05)),
    "today": ("log-range τ=0.05 (today)", lambda: LogRange(0.05)),
}


# -- replay ----------------------------------------------------------------------------------
def replay(rule: Rule, trace: dict[str, list[float]]) -> int | None:
    """Feed a trace (lists ``x`` and ``q`` indexed by step − 1) to a rule; its freeze step."""
    for i, (x, q) in enumerate(zip(trace["x"], trace["q"], strict=True)):
        if rule.observe(i + 1, x, q):
            return i + 1
    return None


def replay_table(traces: dict[str, dict[str, Any]]) -> str:
    """Markdown: rule × task × seed → freeze step; "in the bands" only for 300-step traces of
    both tasks (the bands are those of 300-step runs)."""
    tasks = [t for t in ("digits", "lm") if t in traces]
    seeds = {task: sorted(traces[task], key=int) for task in tasks}
    steps = {len(traces[t][s]["x"]) for t in tasks for s in seeds[t]}
    banded = tasks == ["digits", "lm"] and steps == {300}
    head = ["rule"]
    for task in tasks:
        head += [f"{task} s{s}" for s in seeds[task]]
    head += ["in both bands"] if banded else []
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for name, make in RULES.items():
        cells, ok = [], True
        for task in tasks:
            lo, hi = BANDS[task]
            for s in seeds[task]:
                f = replay(make(), traces[task][s])
                ok &= f is not None and lo <= f <= hi
                cells.append("–" if f is None else str(f))
        verdict = [("**yes**" if ok else "no")] if banded else []
        lines.append("| " + " | ".join([name, *cells, *verdict]) + " |")
    t_n = {task: [_t_n(traces[task][s]) for s in seeds[task]] for task in tasks}
    for task in tasks:  # the stand-alone function decides as the class
        for s in seeds[task]:
            tr = traces[task][s]
            assert signal_anchor_step(tr["x"], tr["q"]) == replay(SignalAnchor(), tr)
    notes = [
        "",
        f"– = did not freeze within the trace ({', '.join(map(str, sorted(steps)))} steps). "
        "min_step = 40 and the window [t − ⌊f·t⌋, t], f = 1/2 unless the rule names f, "
        "for every rule.",
        "t_n (first step with q ≤ 2(1 − β1)/(1 + β1) = 0.105): "
        + "; ".join(f"{task} {t_n[task]}" for task in tasks),
    ]
    if banded:
        notes.insert(1, f"Bands: digits {BANDS['digits']}, LM {BANDS['lm']}.")
    return "\n".join(lines + notes) + "\n"


def _t_n(trace: dict[str, list[float]], k: float = 2.0) -> int | None:
    return next((i + 1 for i, q in enumerate(trace["q"]) if q <= k * noise_floor()), None)


def make_traces(raw: pathlib.Path) -> dict[str, dict[str, Any]]:
    """Compact ``trace_<task>_seed<S>.json`` files (freeze_trace, variant ``adam``) into
    {task: {seed: {x, q, train}}}."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(raw.glob("trace_*_seed*.json")):
        task, seed = path.stem.removeprefix("trace_").split("_seed")
        rows = json.loads(path.read_text())["adam"]["rows"]
        out.setdefault(task, {})[seed] = dict(
            x=[round(sum(math.log(p) for p in r["per"]) / len(r["per"]), 7) for r in rows],
            q=[round(sum(r["snr"]) / len(r["snr"]), 7) for r in rows],
            train=[round(r["train"], 5) for r in rows],
        )
    return out


# -- real runs -------------------------------------------------------------------------------
class RuleAdam(commopt.OnebitAdam):
    """OnebitAdam(freeze_step="auto") whose decision is taken by a replay rule (research only:
    the rule's state is not checkpointed). The rule sees x = the optimizer's own level and
    q = (1/K) Σ_k mean(m̂_k²)/mean(v̂_k) from its buckets; both identical on every rank."""

    def __init__(self, params, rule: Rule, **kwargs) -> None:
        super().__init__(params, freeze_step="auto", **kwargs)
        self._rule = rule

    def _observe_variance(self, step: int, level: VarianceLevel | float, ready: bool = True):
        q_sum, k = 0.0, 0
        for state in self.flat_states:
            m, v = state.flat["exp_avg"], state.flat["exp_avg_sq"]
            for seg, group in self.segments(state):
                b1, b2 = group["betas"]
                c1, c2 = 1 - b1**step, 1 - b2**step
                for mk, vk in zip(seg.views(m), seg.views(v), strict=True):
                    if vk.numel():
                        den = float(vk.double().mean()) / c2
                        q_sum += float(mk.double().square().mean()) / c1**2 / max(den, 1e-30)
                        k += 1
        x = level.log_mean if isinstance(level, VarianceLevel) else math.log(level)
        if self._rule.observe(step, x, q_sum / max(k, 1)):
            self.global_state["auto_freeze_step"] = step
            return True
        return False


def run_rule(
    name: str, task: str, seeds: list[int], sweep: list[int], out: pathlib.Path, steps: int
) -> str:
    label, make_rule = RUNNABLE[name]
    d = DEFAULTS[task]
    tag = "" if steps == d["steps"] else f"_{steps}steps"
    lr, betas = d["lr"], (BETA1, 0.99)

    def fixed(f):
        return lambda params, be: commopt.OnebitAdam(
            params, lr=lr, betas=betas, freeze_step=f, backend=be
        )

    makers = {f"F={f}": fixed(f) for f in sweep}
    makers[f"rule {name}"] = lambda params, be: RuleAdam(
        params, make_rule(), lr=lr, betas=betas, backend=be
    )
    finals: dict[str, list[float]] = {k: [] for k in makers}
    mb: dict[str, list[float]] = {k: [] for k in makers}
    steps_at: list[int | None] = []
    started = time.monotonic()
    for seed in seeds:
        result = run_variants(task, makers, steps, d["eval_every"], 4, overrides={"seed": seed})
        for k, r in result["runs"].items():
            finals[k].append(r["rows"][-1]["val_loss"])
            mb[k].append(r["rows"][-1]["bytes"] / 1e6)
        steps_at.append(result["runs"][f"rule {name}"]["freeze_step"])
        print(
            f"seed {seed}: "
            + ", ".join(f"{k} {v[-1]:.4f}" for k, v in finals.items())
            + f"; rule froze at {steps_at[-1]}",
            flush=True,
        )
    lines = [
        f"## Rule `{name}` ({label}) on {task}, {steps} steps, seeds {seeds}",
        "",
        "| variant | "
        + " | ".join(f"seed {s}" for s in seeds)
        + " | mean | MB/rank (mean) | "
        + " | ".join(f"paired gap to F={f}" for f in sweep)
        + " |",
        "|---|" + "---|" * (len(seeds) + 2 + len(sweep)),
    ]
    for k, vals in finals.items():
        gaps = []
        for f in sweep:
            g = [100 * (v / b - 1) for v, b in zip(vals, finals[f"F={f}"], strict=True)]
            sd = statistics.stdev(g) if len(g) > 1 else 0.0
            gaps.append(f"{statistics.fmean(g):+.1f} % ± {sd:.1f} %")
        lines.append(
            f"| {k} | "
            + " | ".join(f"{v:.4f}" for v in vals)
            + f" | {statistics.fmean(vals):.4f} | {statistics.fmean(mb[k]):.1f} | "
            + " | ".join(gaps)
            + " |"
        )
    lines += [
        "",
        f"Rule froze at: {', '.join('never' if s is None else str(s) for s in steps_at)}.",
        "",
        f"{time.monotonic() - started:.0f} s on {describe_machine()} (end); torch's CPU "
        "kernels capped at AVX2.",
    ]
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"freeze_rule_{name}_{task}{tag}.md"
    path.write_text(text)
    raw = dict(seeds=seeds, finals=finals, mb=mb, freeze_steps=steps_at)
    path.with_suffix(".json").write_text(json.dumps(raw))
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=pathlib.Path, default=TRACES)
    parser.add_argument("--make-traces", type=pathlib.Path, metavar="RAW_DIR")
    parser.add_argument("--run", choices=sorted(RUNNABLE))
    parser.add_argument("--task", choices=["lm", "digits"], default="digits")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--sweep", default="120,200")
    parser.add_argument("--steps", type=int, help="default: the task's (300)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.make_traces:
        args.traces.write_text(json.dumps(make_traces(args.make_traces)))
    if args.run:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        sweep = [int(s) for s in args.sweep.split(",") if s.strip()]
        steps = args.steps or DEFAULTS[args.task]["steps"]
        print(run_rule(args.run, args.task, seeds, sweep, args.out, steps))
        return 0
    table = replay_table(json.loads(args.traces.read_text()))
    args.out.mkdir(parents=True, exist_ok=True)
    name = "freeze_rules_replay.md" if args.traces == TRACES else f"{args.traces.stem}_replay.md"
    (args.out / name).write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
