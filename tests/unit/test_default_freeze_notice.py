"""The default freeze step (100000 full-precision steps: no compression in most fine-tuning
runs) is announced when the user leaves it out, and never when they give it."""

from __future__ import annotations

import warnings

import pytest
import torch

import commopt
from commopt.optim import config
from tests.optim_registry import BY_NAME


@pytest.mark.parametrize("name", list(BY_NAME))
def test_the_default_is_announced_once_and_an_explicit_value_never(name, monkeypatch) -> None:
    monkeypatch.setattr(config, "_announced", set())
    monkeypatch.delenv("RANK", raising=False)
    cls, field = BY_NAME[name].cls, BY_NAME[name].freeze_key
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.warns(
        UserWarning, match=rf"{name}: {field} was not given, so its default of 100000"
    ):
        opt = cls(params)
    # attributed to the line above, not to commopt or the config's generated __init__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monkeypatch.setattr(config, "_announced", set())
        cls(params)
    assert [w.filename for w in caught] == [__file__]
    assert type(opt.config.__dict__[field]) is int and getattr(opt, field) == 100_000
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cls(params)  # once per process
        monkeypatch.setattr(config, "_announced", set())
        cls(params, **{field: 100_000})
        cls(params, **{field: "auto"})


def test_only_rank_zero_announces(monkeypatch) -> None:
    monkeypatch.setattr(config, "_announced", set())
    monkeypatch.setenv("RANK", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        commopt.OnebitAdam([torch.nn.Parameter(torch.zeros(3))])
