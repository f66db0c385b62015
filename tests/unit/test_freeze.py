"""commopt.optim.freeze: the automatic freeze rule, its state round trip and its argument checks."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import random

import pytest
import torch

import commopt
from commopt.optim.freeze import (
    AutoFreeze,
    AutoFreezeSettings,
    VarianceLevel,
    auto_settings,
    settled_step,
    variance_level,
)


def _levels(n: int, scale: float = 1.0) -> list[float]:
    """A level that falls fast, then settles: 1 + 4·e^(−t/(15·scale)) plus a small wobble."""
    return [1.0 + 4.0 * math.exp(-t / (15 * scale)) + 0.002 * math.sin(t) for t in range(1, n + 1)]


def _first_fire(
    levels: list[float], fraction: float, threshold: float, min_step: int
) -> int | None:
    """The rule written out directly: the first t ≥ min_step at which the logs of the levels of
    steps t − ⌊f·t⌋ … t lie within ``threshold`` of each other."""
    for t in range(min_step, len(levels) + 1):
        window = [math.log(lv) for lv in levels[t - math.floor(fraction * t) - 1 : t]]
        if max(window) - min(window) <= threshold:
            return t
    return None


@pytest.mark.parametrize(("fraction", "threshold"), [(0.5, 0.05), (0.25, 0.05), (0.5, 0.2)])
def test_freezes_where_the_written_out_rule_says(fraction, threshold):
    levels = _levels(300)
    want = _first_fire(levels, fraction, threshold, min_step=40)
    assert want is not None and 40 < want < 300
    auto = AutoFreeze(fraction=fraction, threshold=threshold)
    got = [auto.observe(t, lv) for t, lv in enumerate(levels, start=1)]
    assert auto.frozen_at == want
    assert got == [t >= want for t in range(1, 301)]  # once frozen, always frozen
    assert auto.last_change is not None and auto.last_change <= threshold


def test_window_range_matches_brute_force_on_random_levels():
    """The monotone queues give max − min of the window's logs at every step."""
    rng = random.Random(3)
    levels = [math.exp(rng.gauss(0.0, 0.3)) for _ in range(400)]
    auto = AutoFreeze(min_step=400, max_step=1000, fraction=0.4, threshold=0.01)
    for t, lv in enumerate(levels, start=1):
        auto.observe(t, lv)
        window = [math.log(x) for x in levels[t - math.floor(0.4 * t) - 1 : t]]
        assert auto.last_change == max(window) - min(window), t


def test_a_maximum_inside_the_window_blocks_the_decision():
    """Flat, then a bump (up by half and back between steps 60 and 100), then flat. At step 100
    the level equals its value at the window's start (50): the first rule's test of the two
    ends would pass; the range does not until the bump has left the window (t − t/2 > 99)."""
    levels = [
        1.0 + (0.5 * math.sin(math.pi * (t - 60) / 40) if 60 < t < 100 else 0.0)
        for t in range(1, 301)
    ]
    assert levels[99] == levels[49]
    auto = AutoFreeze(min_step=100)
    fired = [auto.observe(t, lv) for t, lv in enumerate(levels, start=1)]
    assert auto.frozen_at == _first_fire(levels, 0.5, 0.05, 100) == fired.index(True) + 1
    assert auto.frozen_at > 190


def test_the_decision_scales_with_time_and_ignores_the_unit_of_the_level():
    """A run k times slower decides about k times later (the window is a fraction of the steps
    so far); multiplying every level by a constant changes nothing (logs)."""
    fast = AutoFreeze(max_step=10**6)
    slow = AutoFreeze(max_step=10**6)
    for t, lv in enumerate(_levels(400), start=1):
        if fast.observe(t, lv):
            break
    for t, lv in enumerate(_levels(4000, scale=10), start=1):
        if slow.observe(t, lv):
            break
    assert fast.frozen_at is not None and slow.frozen_at is not None
    assert 9.0 <= slow.frozen_at / fast.frozen_at <= 11.0, (fast.frozen_at, slow.frozen_at)
    scaled = AutoFreeze()
    decided = next(t for t, lv in enumerate(_levels(300), 1) if scaled.observe(t, 1e-6 * lv))
    assert decided == fast.frozen_at


def test_min_and_max_step_bound_the_decision():
    flat = [1.0] * 100  # settled from the start: the minimum decides
    auto = AutoFreeze(min_step=30)
    assert [auto.observe(t, lv) for t, lv in enumerate(flat, 1)].index(True) + 1 == 30
    moving = [float(t) for t in range(1, 101)]  # ln(t/(t/2)) = ln 2 > τ at every step
    auto = AutoFreeze(min_step=10, max_step=60)
    fired = [auto.observe(t, lv) for t, lv in enumerate(moving, 1)]
    assert fired.index(True) + 1 == 60 and auto.frozen_at == 60


def test_the_window_must_be_covered_by_observations():
    """Observed from step 50 only: the window t − ⌊t/2⌋ … t starts at the first observation
    from t = 99 on, so a flat level freezes there, not at min_step."""
    auto = AutoFreeze(min_step=40)
    fired = [auto.observe(t, 1.0) for t in range(50, 200)]
    assert auto.frozen_at == 99 and fired.index(True) + 50 == 99


def test_decision_is_logged_once(caplog):
    auto = AutoFreeze(min_step=3, threshold=0.5)
    with caplog.at_level(logging.INFO, logger="commopt.optim.freeze"):
        for t in range(1, 20):
            auto.observe(t, 1.0)
    records = [r for r in caplog.records if "frozen automatically" in r.getMessage()]
    assert len(records) == 1 and "at step 3" in records[0].getMessage()


def test_state_dict_round_trip_resumes_exactly():
    levels = _levels(200)
    whole = AutoFreeze()
    decisions = [whole.observe(t, lv) for t, lv in enumerate(levels, 1)]
    assert whole.frozen_at is not None
    for cut in (1, 25, 41, 70, whole.frozen_at - 1, whole.frozen_at, 150):
        first = AutoFreeze()
        for t in range(1, cut + 1):
            first.observe(t, levels[t - 1])
        saved = copy.deepcopy(first.state_dict())
        resumed = AutoFreeze()
        resumed.load_state_dict(saved)
        rest = [resumed.observe(t, levels[t - 1]) for t in range(cut + 1, 201)]
        assert rest == decisions[cut:], cut
        assert resumed.state_dict() == whole.state_dict(), cut


def _first_rule_state(frozen_at: int | None) -> dict:
    """The state layout the first rule saved (Σ mean √v̂ over a window of 20 observations)."""
    return {
        "min_step": 40,
        "max_step": 100_000,
        "window": 20,
        "threshold": 0.05,
        "frozen_at": frozen_at,
        "last_step": 60,
        "last_change": 0.04,
        "levels": [1.0] * 21,
    }


def test_first_rule_states_load_when_decided_and_are_refused_otherwise():
    auto = AutoFreeze()
    auto.load_state_dict(_first_rule_state(55))
    assert auto.frozen_at == 55 and auto.observe(61, 1.0)
    with pytest.raises(ValueError, match="saved by the previous automatic freeze rule before it"):
        AutoFreeze().load_state_dict(_first_rule_state(None))
    with pytest.raises(ValueError, match="unknown rule 'other'"):
        AutoFreeze().load_state_dict({**AutoFreeze().state_dict(), "rule": "other"})


def test_an_optimizer_refuses_an_undecided_first_rule_state_at_load():
    w = torch.nn.Parameter(torch.ones(4))
    single = commopt.SingleProcessBackend()
    opt = commopt.OnebitAdam([w], lr=0.1, freeze_step="auto", backend=single)
    for _ in range(3):
        opt.zero_grad()
        (w**2).sum().backward()
        opt.step()
    saved = opt.state_dict()
    undecided = copy.deepcopy(saved)
    undecided["commopt"]["global"]["auto_freeze"] = _first_rule_state(None)
    fresh = commopt.OnebitAdam([w], lr=0.1, freeze_step="auto", backend=single)
    with pytest.raises(ValueError, match=r"int freeze_step .* allow_config_change=True"):
        fresh.load_state_dict(undecided)
    decided = copy.deepcopy(saved)
    decided["commopt"]["global"]["auto_freeze"] = _first_rule_state(2)
    decided["commopt"]["global"]["auto_freeze_step"] = 2
    fresh = commopt.OnebitAdam([w], lr=0.1, freeze_step="auto", backend=single)
    fresh.load_state_dict(decided)
    assert fresh.frozen_after() == 2
    fresh.zero_grad()
    (w**2).sum().backward()
    fresh.step()  # compression stage: the rule is not consulted again
    assert fresh.frozen_after() == 2


def test_observe_rejects_bad_input():
    auto = AutoFreeze()
    auto.observe(5, 1.0)
    with pytest.raises(ValueError, match="step 5 is not after the last observed step 5"):
        auto.observe(5, 1.0)
    with pytest.raises(ValueError, match="level must be finite"):
        auto.observe(6, float("nan"))
    with pytest.raises(ValueError, match="level must be finite and >= 0"):
        auto.observe(6, -1.0)
    with pytest.raises(TypeError, match="level must be a VarianceLevel"):
        auto.observe(6, "1.0")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"min_step": 0}, ValueError, "Invalid min_step: 0"),
        ({"min_step": 50, "max_step": 10}, ValueError, "Invalid max_step: 10"),
        ({"fraction": 0.0}, ValueError, "Invalid fraction: 0.0"),
        ({"fraction": 1.0}, ValueError, "Invalid fraction: 1.0"),
        ({"fraction": "half"}, TypeError, "Invalid fraction: 'half'"),
        ({"threshold": 0.0}, ValueError, "Invalid threshold: 0.0"),
        ({"threshold": 1.5}, ValueError, "Invalid threshold: 1.5"),
        ({"min_step": 2.5}, TypeError, "Invalid min_step: 2.5"),
    ],
)
@pytest.mark.parametrize("make", [AutoFreeze, AutoFreezeSettings])
def test_invalid_settings_are_rejected(kwargs, error, match, make):
    with pytest.raises(error, match=match):
        make(**kwargs)


def test_settings_are_one_frozen_value():
    assert AutoFreeze().settings == AutoFreezeSettings() == auto_settings("auto")
    mine = AutoFreezeSettings(min_step=10, max_step=500, fraction=0.25, threshold=0.1)
    auto = AutoFreeze.from_settings(mine)
    assert auto.settings == mine and auto_settings(mine) is mine
    assert (auto.min_step, auto.max_step, auto.fraction, auto.threshold) == (10, 500, 0.25, 0.1)
    assert auto_settings(100) is None and auto_settings("soon") is None
    assert AutoFreezeSettings(fraction=0.5, threshold=0.05) == AutoFreezeSettings()
    assert type(AutoFreezeSettings(threshold=0.5).threshold) is float
    with pytest.raises(dataclasses.FrozenInstanceError):
        mine.threshold = 0.2  # type: ignore[misc]
    auto.raise_min_step(80)
    assert auto.min_step == 80 and auto.settings == dataclasses.replace(mine, min_step=80)


def test_settled_step_matches_its_definition():
    for beta2 in (0.9, 0.99, 0.999):
        for tau in (0.05, 0.1):
            t = settled_step(beta2, tau)
            assert math.sqrt(1 - beta2**t) >= 1 - tau
            assert math.sqrt(1 - beta2 ** (t - 1)) < 1 - tau
    assert settled_step(0.999, 0.05) == 2327  # ≈ 2.33/(1 − β2): v at 90 % of its level
    auto = AutoFreeze(min_step=40, max_step=1000)
    auto.raise_min_step(settled_step(0.999, 0.05))
    assert auto.min_step == 1000  # capped at max_step


def test_variance_level_sums_logs_of_per_tensor_means_of_the_denominator():
    a = torch.tensor([4.0, 16.0])  # √: 2, 4 → mean 3
    b = torch.tensor([[1.0]])  # √: 1 → mean 1
    zero = torch.zeros(3)  # no variance yet: not counted
    level = variance_level([a, b, torch.empty(0), zero])
    assert level == VarianceLevel(math.log(3.0) + math.log(1.0), 2)
    assert level.log_mean == pytest.approx(math.log(3.0) / 2, abs=0)
    assert variance_level([a], bias_correction=4.0) == VarianceLevel(math.log(1.5), 1)
    total = 0.0  # how the optimizers add the buckets' levels up
    total += variance_level([a])
    total += variance_level([b])
    assert total == level == sum([variance_level([a]), variance_level([b])])
    assert VarianceLevel().log_mean == -math.inf


def _undecided_state(cut: int, **settings) -> tuple[dict, list[float]]:
    """A rule's state after ``cut`` observations of the settling levels, still undecided."""
    levels = _levels(400)
    first = AutoFreeze(**settings)
    for t in range(1, cut + 1):
        assert not first.observe(t, levels[t - 1])
    return copy.deepcopy(first.state_dict()), levels


@pytest.mark.parametrize(
    "settings",
    [
        {"threshold": 0.2},  # looser: earlier (83)
        {"min_step": 150},  # later than the default decision (131)
        {"min_step": 10, "max_step": 25},  # the cap is behind: decides at the next step
        {"threshold": 0.01, "max_step": 400},
    ],
)
def test_an_undecided_state_continues_under_new_constants(settings):
    """min_step, max_step and threshold judge the saved history as if they had been set from
    the start (the window's observations do not depend on them)."""
    cut = 30
    saved, levels = _undecided_state(cut)
    resumed = AutoFreeze(**settings)
    resumed.load_state_dict(saved)
    fired = [resumed.observe(t, levels[t - 1]) for t in range(cut + 1, 401)]
    want = dict(min_step=40, max_step=100_000, fraction=0.5, threshold=0.05) | settings
    first = _first_fire(levels, want["fraction"], want["threshold"], want["min_step"]) or 10**9
    expected = min(max(first, cut + 1), max(want["max_step"], cut + 1))
    assert resumed.frozen_at == expected == fired.index(True) + cut + 1
    assert resumed.settings == AutoFreezeSettings(**want)
    assert resumed.state_dict()["threshold"] == want["threshold"]


def test_a_smaller_fraction_continues_exactly_and_a_larger_one_is_refused():
    """The saved queues hold every observation the window [t − ⌊f·t⌋, t] can still need; a
    smaller f needs a subset, a larger f observations that were dropped."""
    cut = 35
    saved, levels = _undecided_state(cut, min_step=1000, max_step=2000)
    resumed = AutoFreeze(min_step=1000, max_step=2000, fraction=0.25)
    resumed.load_state_dict(saved)
    fresh = AutoFreeze(min_step=1000, max_step=2000, fraction=0.25)
    for t in range(1, cut + 1):
        fresh.observe(t, levels[t - 1])
    for t in range(cut + 1, 300):
        resumed.observe(t, levels[t - 1])
        fresh.observe(t, levels[t - 1])
        assert resumed.last_change == fresh.last_change, t
    assert resumed.state_dict() == fresh.state_dict()
    with pytest.raises(ValueError, match=r"fraction 0\.5 .* fraction 0\.75 needs older obs"):
        AutoFreeze(fraction=0.75).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"Resume with fraction <= 0\.5 .* int freeze_step"):
        AutoFreeze(fraction=0.75).load_state_dict(saved)


def test_a_decided_state_keeps_its_decision_whatever_the_settings():
    levels = _levels(300)
    first = AutoFreeze()
    decided = next(t for t, lv in enumerate(levels, 1) if first.observe(t, lv))
    for settings in ({"fraction": 0.9}, {"max_step": 41}, {"min_step": 250, "threshold": 0.9}):
        resumed = AutoFreeze(**settings)
        resumed.load_state_dict(copy.deepcopy(first.state_dict()))
        assert resumed.frozen_at == decided and resumed.observe(decided + 1, 100.0)
