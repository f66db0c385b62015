"""``load_state_dict`` refuses a state dict another commopt optimizer saved (it loaded
silently, or failed later with a bare ``KeyError: 'local_interval'``), with checkpoints saved
before the class was recorded too."""

from __future__ import annotations

import itertools

import pytest
import torch

from commopt.comm import SingleProcessBackend
from tests.optim_registry import BY_NAME

NAMES = tuple(BY_NAME)


def _trained(name: str) -> torch.optim.Optimizer:
    w = torch.nn.Parameter(torch.ones(4))
    opt = BY_NAME[name].make([w], freeze=2, backend=SingleProcessBackend())
    for _ in range(3):
        w.grad = torch.full((4,), 0.5)
        opt.step()
    return opt


@pytest.mark.parametrize(("saved", "loading"), list(itertools.permutations(NAMES, 2)))
@pytest.mark.parametrize("old_format", [False, True])
def test_another_class_state_is_refused(saved: str, loading: str, old_format: bool) -> None:
    sd = _trained(saved).state_dict()
    if old_format:
        del sd["commopt"]["optimizer"]
    target = _trained(loading)
    with pytest.raises(ValueError, match=f"saved by {saved}, whose state"):
        target.load_state_dict(sd)


@pytest.mark.parametrize("name", NAMES)
def test_the_same_class_loads(name: str) -> None:
    sd = _trained(name).state_dict()
    assert sd["commopt"]["optimizer"] == name
    _trained(name).load_state_dict(sd)
