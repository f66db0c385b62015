"""error_feedback="econtrol" on the three optimizers, 2 forked gloo ranks: replicas stay
bit-identical, EControl's buffers are saved per rank and a resume is bit-exact, and a classic
checkpoint is not loaded into EControl buffers."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import commopt
from tests.multirank.harness import run_ranks
from tests.optim_registry import BY_NAME

TIMEOUT = 300.0
STEPS = 24


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def _make(kind: str, params, backend, mode: str = "econtrol"):
    """The registry's optimizer with EControl (or classic feedback: ``mode="standalone"``),
    full precision up to step 8 (a resume at step 12 lands in the compressed phase)."""
    return BY_NAME[kind].make(params, mode=mode, freeze=8, backend=backend, econtrol_eta=0.2)


def _train(model, opt, rank: int, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(100 * step + rank)  # each rank its own data
        x = torch.randn(16, 5, generator=gen) + rank
        opt.zero_grad()
        ((model(x) - x[:, :3].sin()) ** 2).mean().backward()
        opt.step()


def _flat(opt, model) -> torch.Tensor:
    parts = [p.detach().reshape(-1) for p in model.parameters()]
    for p in model.parameters():
        parts += [v.reshape(-1) for v in opt.state[p].values() if torch.is_tensor(v)]
    return torch.cat(parts)


def _run(backend, kind: str):
    rank = backend.rank
    model = _model()
    opt = _make(kind, model.parameters(), backend)
    _train(model, opt, rank, range(STEPS))
    whole = _flat(opt, model)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    comm = opt.state_dict()["commopt"]
    names = sorted(k for k in comm["buckets"][0] if k != "numel")

    model2 = _model()
    first = _make(kind, model2.parameters(), backend)
    _train(model2, first, rank, range(STEPS // 2))
    saved = copy.deepcopy(first.state_dict())
    resumed = _make(kind, model2.parameters(), backend)
    resumed.load_state_dict(saved)
    _train(model2, resumed, rank, range(STEPS // 2, STEPS))
    exact = bool(torch.equal(_flat(resumed, model2), whole))

    classic = _make(kind, _model().parameters(), backend, mode="standalone")
    _train(_model(), classic, rank, range(2))
    target = _make(kind, _model().parameters(), backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        target.load_state_dict(classic.state_dict(), allow_config_change=True)
        _train(_model(), target, rank, range(1))
    reset = any("'flat' exchange, now 'flat-econtrol'" in str(w.message) for w in caught)
    return params, comm["exchange"], names, exact, reset


@pytest.mark.parametrize("kind", list(BY_NAME))
def test_econtrol_optimizers_identical_replicas_and_exact_resume(kind):
    results = run_ranks(_run, 2, kind, timeout=TIMEOUT)
    assert BY_NAME[kind].communicates(STEPS, 8)  # the last step: replicas agree
    for params, exchange, names, exact, reset in results:
        assert torch.equal(params, results[0][0])  # bit-identical replicas
        assert exchange == "flat-econtrol"
        assert names == [
            "mean_estimate",
            "server_error",
            "started",
            "worker_error",
            "worker_estimate",
        ]
        assert exact
        assert reset


def _topology(backend, local_size: int, topology: str):
    """Fake nodes of ``local_size`` ranks through the launcher's env, then ask for EControl."""
    import os

    os.environ.update(
        LOCAL_RANK=str(backend.rank % local_size),
        LOCAL_WORLD_SIZE=str(local_size),
        GROUP_RANK=str(backend.rank // local_size),
    )
    w = torch.nn.Parameter(torch.ones(8))
    opt = commopt.OnebitAdam([w], freeze_step=1, topology=topology, error_feedback="econtrol")
    try:
        return opt.exchange.name
    except ValueError as err:
        return str(err)


def test_econtrol_runs_flat_and_refuses_a_hierarchical_exchange():
    # one rank per node: "auto" resolves to flat, and EControl applies
    assert set(run_ranks(_topology, 4, 1, "auto", timeout=TIMEOUT)) == {"flat-econtrol"}
    # 2 nodes × 2 ranks: hierarchical, which has no EControl: every rank refuses alike
    for message in run_ranks(_topology, 4, 2, "hierarchical", timeout=TIMEOUT):
        assert "implemented for the flat exchange only" in message
        assert "use topology='flat' or error_feedback='classic'" in message
