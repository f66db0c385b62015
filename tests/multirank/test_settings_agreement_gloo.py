"""Ranks that disagree on a hyperparameter get one clear error on every rank (issue #41.3).

Before, two ranks built with different ``lr``, ``betas`` or ``weight_decay`` took different
steps from the same averaged gradients and drifted apart silently. Now the per-step agreement
carries a digest of the settings, and the first communicating step after a difference raises
the same ``ValueError`` on every rank, naming the setting and each rank's value.
"""

from __future__ import annotations

import pytest
import torch

from tests.multirank.harness import RankError, run_ranks
from tests.optim_registry import OPTIMIZERS

#: (constructor override on rank 1, the setting the message names, rank 0's and rank 1's text)
AT_CONSTRUCTION = [
    ({"lr": 0.02}, "param_groups[0]['lr']", None, "0.02"),
    ({"betas": (0.8, 0.999)}, "param_groups[0]['betas']", "(0.9, 0.999)", "(0.8, 0.999)"),
    ({"weight_decay": 0.1}, "param_groups[0]['weight_decay']", "0.0", "0.1"),
]


def _run(backend, name: str, override: dict, change_at: int | None) -> int:
    from tests.optim_registry import BY_NAME

    info = BY_NAME[name]
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(7, 3)), torch.nn.Parameter(torch.randn(5))]
    opt = info.make(params, **(override if change_at is None and backend.rank == 1 else {}))
    gen = torch.Generator().manual_seed(backend.rank)
    for step in range(1, info.steps + 1):
        if change_at == step and backend.rank == 1:
            for key, value in override.items():
                opt.param_groups[0][key] = value
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return opt.global_state["step"]


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize(("override", "setting", "v0", "v1"), AT_CONSTRUCTION)
def test_different_hyperparameters_fail_at_the_first_step(info, override, setting, v0, v1):
    with pytest.raises(RankError) as caught:
        run_ranks(_run, 2, info.name, override, None, timeout=60)
    v0 = v0 or repr(info.config["lr"])
    for r, message in enumerate(caught.value.messages):
        assert message is not None, f"rank {r} went on"
        assert f"ValueError: {info.name}: {setting} differs between ranks: " in message, message
        assert f"rank 0 {v0}, rank 1 {v1}" in message, message


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_a_change_on_one_rank_fails_at_the_next_communicating_step(info):
    change_at = 3
    with pytest.raises(RankError) as caught:
        run_ranks(_run, 2, info.name, {"lr": 0.5}, change_at, timeout=60)
    for message in caught.value.messages:
        assert message is not None
        assert "param_groups[0]['lr'] differs between ranks" in message, message
        assert "rank 1 0.5" in message, message


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_the_same_change_on_every_rank_is_fine(info):
    def same(backend, name):
        from tests.optim_registry import BY_NAME

        info = BY_NAME[name]
        params = [torch.nn.Parameter(torch.ones(4))]
        opt = info.make(params)
        for step in range(1, info.steps + 1):
            opt.param_groups[0]["lr"] = 0.01 / step  # a scheduler, on every rank
            params[0].grad = torch.full((4,), float(backend.rank + 1))
            opt.step()
        return params[0].detach().clone()

    results = run_ranks(same, 2, info.name, timeout=60)
    assert torch.equal(results[0], results[1])
