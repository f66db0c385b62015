"""freeze_step=AutoFreezeSettings(...) on the three optimizers, in one process: the constants
reach the rule, ``"auto"`` is ``AutoFreezeSettings()``, resume across settings, the saved form.

The runs are the noisy regression of tests/unit/test_beyond_options.py with the registry's
optimizers (lr 0.01, ``dense_variance``), where the default rule decides at step 71 (OnebitAdam),
101 (OnebitLamb) and 128 (ZeroOneAdam).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import io
from typing import Any, NamedTuple
from unittest import mock

import pytest
import torch

import commopt
from commopt import AutoFreezeSettings
from commopt.optim.freeze import AutoFreeze
from tests.optim_registry import BY_NAME
from tests.unit.test_beyond_options import NOISY, SINGLE, _model, _state, _train

KINDS = tuple(BY_NAME)
STEPS = 150  # past every default decision, so the compression stage is compared too
CUT = 35  # an undecided save: before min_step = 40
LOOSER = AutoFreezeSettings(threshold=0.1)  # decides earlier than the default
CAPPED = AutoFreezeSettings(threshold=0.02, max_step=90)  # never settles that far: max_step


def _make(kind: str, freeze: Any, params) -> torch.optim.Optimizer:
    info = BY_NAME[kind]
    return info.make(params, freeze=freeze, lr=0.01, backend=SINGLE, **info.dense_variance)


class Run(NamedTuple):
    decided: int | None
    state: list[torch.Tensor]
    global_state: dict[str, Any]
    observed: list[tuple]  # (step, level, ready) as AutoFreeze.observe received them


def _observing(steps_and_calls: list[tuple]):
    """Record what every AutoFreeze.observe receives (and let it run)."""
    original = AutoFreeze.observe

    def spy(self, step, level, ready=True):
        steps_and_calls.append((step, level, ready))
        return original(self, step, level, ready)

    return mock.patch.object(AutoFreeze, "observe", spy)


@functools.cache
def _run(kind: str, freeze: Any, steps: int = STEPS) -> Run:
    """An uninterrupted run (cached: the runs below compare against the same ones)."""
    model = _model()
    opt = _make(kind, freeze, model.parameters())
    observed: list[tuple] = []
    with _observing(observed):
        _train(model, opt, range(steps), NOISY)
    gs = copy.deepcopy(opt.global_state)
    return Run(gs.get("auto_freeze_step"), _state(opt, model), gs, observed)


def _resume(kind: str, saved_with: Any, resumed_with: Any, cut: int, **load: Any) -> Run:
    """Save after ``cut`` steps under ``saved_with``, load into an optimizer built with
    ``resumed_with`` and train on to STEPS."""
    model = _model()
    first = _make(kind, saved_with, model.parameters())
    _train(model, first, range(cut), NOISY)
    saved = copy.deepcopy(first.state_dict())
    resumed = _make(kind, resumed_with, model.parameters())
    resumed.load_state_dict(saved, **load)
    observed: list[tuple] = []
    with _observing(observed):
        _train(model, resumed, range(cut, STEPS), NOISY)
    gs = resumed.global_state
    return Run(gs.get("auto_freeze_step"), _state(resumed, model), gs, observed)


def _assert_same(a: Run, b: Run) -> None:
    assert a.decided == b.decided and a.global_state == b.global_state
    assert len(a.state) == len(b.state)
    for x, y in zip(a.state, b.state, strict=True):
        assert torch.equal(x, y)


def _replay(settings: AutoFreezeSettings, observed: list[tuple], start: AutoFreeze | None = None):
    """The step a stand-alone rule with ``settings`` decides on these observations."""
    rule = start or AutoFreeze.from_settings(settings)
    return next((s for s, level, ready in observed if rule.observe(s, level, ready)), None)


@pytest.mark.parametrize("kind", KINDS)
def test_the_settings_reach_the_rule(kind):
    default = _run(kind, "auto").decided
    assert default is not None and default == _replay(
        AutoFreezeSettings(), _run(kind, "auto").observed
    )
    looser = _run(kind, LOOSER)
    assert looser.decided is not None and 40 <= looser.decided < default, (looser, default)
    assert looser.decided == _replay(LOOSER, looser.observed)
    capped = _run(kind, CAPPED)
    assert capped.decided is not None and 90 <= capped.decided < 90 + 4, capped.decided
    assert capped.decided == _replay(CAPPED, capped.observed)
    assert capped.global_state["auto_freeze"]["last_change"] > 0.02  # the cap decided


@pytest.mark.parametrize("kind", KINDS)
def test_auto_is_the_default_settings_and_checkpoints_load_across(kind):
    auto = _run(kind, "auto")
    _assert_same(_run(kind, AutoFreezeSettings()), auto)
    default_values = AutoFreezeSettings(min_step=40, max_step=100_000, fraction=0.5)
    for saved_with, resumed_with, cut in (
        ("auto", default_values, CUT),
        (default_values, "auto", 80),
    ):
        _assert_same(_resume(kind, saved_with, resumed_with, cut), auto)  # no config change


@pytest.mark.parametrize("kind", KINDS)
def test_resume_under_other_settings_needs_allow_and_continues_under_them(kind):
    field = BY_NAME[kind].freeze_key
    model = _model()
    first = _make(kind, "auto", model.parameters())
    _train(model, first, range(CUT), NOISY)
    saved = copy.deepcopy(first.state_dict())
    other = _make(kind, LOOSER, model.parameters())
    with pytest.raises(ValueError, match=rf"{field}: saved 'auto', now AutoFreezeSettings\("):
        other.load_state_dict(saved)
    with pytest.raises(ValueError, match=r"threshold=0\.1\).*allow_config_change=True"):
        other.load_state_dict(saved)
    # allowed: the saved observations continue under the new constants, exactly as a run that
    # had them from the start (the warmup does not depend on them before the decision)
    with pytest.warns(UserWarning, match=rf"changed config: {field}: saved 'auto'"):
        resumed = _resume(kind, "auto", LOOSER, CUT, allow_config_change=True)
    _assert_same(resumed, _run(kind, LOOSER))
    assert resumed.decided != _run(kind, "auto").decided


@pytest.mark.parametrize("kind", KINDS)
def test_a_larger_fraction_is_refused_and_a_decision_is_kept(kind):
    model = _model()
    first = _make(kind, "auto", model.parameters())
    _train(model, first, range(CUT), NOISY)
    saved = copy.deepcopy(first.state_dict())
    wider = _make(kind, AutoFreezeSettings(fraction=0.75), model.parameters())
    before = copy.deepcopy(wider.global_state)
    with (
        pytest.warns(UserWarning, match="changed config"),
        pytest.raises(ValueError, match=r"fraction 0\.75 needs older observations"),
    ):
        wider.load_state_dict(saved, allow_config_change=True)
    assert wider.global_state == before and before["step"] == 0  # refused before any change
    assert wider.state_dict()["state"] == {}

    decided = _run(kind, "auto").decided
    _train(model, first, range(CUT, decided + 3), NOISY)
    other = _make(kind, AutoFreezeSettings(min_step=10, threshold=0.5), model.parameters())
    with pytest.warns(UserWarning, match="changed config"):
        other.load_state_dict(copy.deepcopy(first.state_dict()), allow_config_change=True)
    assert other.frozen_after() == decided  # a decided state keeps its decision


@pytest.mark.parametrize("kind", KINDS)
def test_the_saved_config_is_a_plain_dict_that_weights_only_loads(kind):
    model = _model()
    opt = _make(kind, LOOSER, model.parameters())
    _train(model, opt, range(CUT), NOISY)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert saved["commopt"]["config"][BY_NAME[kind].freeze_key] == dataclasses.asdict(LOOSER)
    resumed = _make(kind, LOOSER, model.parameters())
    resumed.load_state_dict(saved)  # the dict equals the settings: no config change
    _train(model, resumed, range(CUT, STEPS), NOISY)
    _assert_same(
        Run(
            resumed.global_state["auto_freeze_step"],
            _state(resumed, model),
            resumed.global_state,
            [],
        ),
        _run(kind, LOOSER),
    )


def test_save_checkpoint_with_settings(tmp_path):
    model = _model()
    opt = commopt.OnebitAdam(model.parameters(), lr=0.01, freeze_step=CAPPED, backend=SINGLE)
    _train(model, opt, range(5), NOISY)
    commopt.save_checkpoint(tmp_path / "ck", model, opt, step=5)  # checks weights_only loading
    fresh = _model(seed=1)
    again = commopt.OnebitAdam(fresh.parameters(), lr=0.01, freeze_step=CAPPED, backend=SINGLE)
    assert commopt.load_checkpoint(tmp_path / "ck", fresh, again) == {"step": 5}
    assert again.global_state == opt.global_state and again.freeze_step == CAPPED


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda p: commopt.OnebitAdam(p, freeze_step=2.5), TypeError, "Invalid freeze_step: 2.5"),
        (
            lambda p: commopt.ZeroOneAdam(p, var_freeze_step={"threshold": 0.1}),
            TypeError,
            r"Invalid var_freeze_step: \{'threshold': 0.1\} \(must be an int >= 1, 'auto' or a "
            r"commopt.AutoFreezeSettings\)",
        ),
        (
            lambda p: commopt.OnebitLamb(p, freeze_step="Auto"),
            ValueError,
            r"Invalid freeze_step: 'Auto' \(must be an int >= 1, 'auto' or a commopt.AutoFreeze",
        ),
        (
            lambda p: commopt.OnebitAdam(p, freeze_step=AutoFreezeSettings(threshold=1.5)),
            ValueError,
            r"Invalid threshold: 1.5 \(must be in \(0, 1\)\)",
        ),
        (
            lambda p: commopt.ZeroOneAdam(p, var_freeze_step=AutoFreezeSettings(max_step=20)),
            ValueError,
            "Invalid max_step: 20 .must be >= min_step = 40",
        ),
        (
            lambda p: commopt.OnebitLamb(p, freeze_step=AutoFreezeSettings(min_step="40")),
            TypeError,
            "Invalid min_step: '40' .must be an int",
        ),
    ],
)
def test_invalid_freeze_values_name_the_field(make, error, match):
    with pytest.raises(error, match=match):
        make([torch.nn.Parameter(torch.zeros(2))])


def test_deepspeed_config_keeps_refusing_auto_and_takes_settings_as_an_override():
    w = torch.nn.Parameter(torch.zeros(3))
    block = {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": "auto"}}
    with pytest.raises(ValueError, match=r"param 'freeze_step' is 'auto'.*pass it as a keyword"):
        commopt.from_deepspeed_config([w], block)
    opt = commopt.from_deepspeed_config([w], block, freeze_step=LOOSER)
    assert opt.freeze_step == LOOSER and opt.auto_freeze.settings == LOOSER
    with pytest.raises(ValueError, match=r"freeze_step=AutoFreezeSettings.*DeepSpeed does not"):
        commopt.to_deepspeed_config(opt)
    zero = commopt.ZeroOneAdam([w], var_freeze_step="auto")
    with pytest.raises(ValueError, match="var_freeze_step='auto' is an automatic freeze"):
        commopt.to_deepspeed_config(zero)
