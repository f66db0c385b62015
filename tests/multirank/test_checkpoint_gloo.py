"""Checkpoints across gloo ranks: bit-exact resume, per-rank state, world-size change policy."""

from __future__ import annotations

import warnings

import pytest
import torch

import commopt
from commopt.checkpoint import CheckpointError
from tests.multirank.harness import run_ranks
from tests.optim_registry import BY_NAME, OPTIMIZERS

TIMEOUT = 180


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(5, 3)
        # A buffer that differs between ranks, like BatchNorm statistics computed locally.
        self.register_buffer("seen", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x[:2, 0].detach())
        return self.b(torch.tanh(self.a(x)))


def _net(seed: int) -> _Net:
    torch.manual_seed(seed)
    return _Net()


def _train(model, opt, rank: int, steps: range) -> None:
    for t in steps:
        g = torch.Generator().manual_seed(100 * t + rank)  # each rank its own data
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _errors_matter(info, stop: int) -> bool:
    """A step up to ``stop`` exchanged at one bit (the error buffers are live) and the next step
    does not reset them."""
    phases = info.phases()
    compressed = any(
        ph.communicates and not ph.updates_variance and ph.first <= stop for ph in phases
    )
    return compressed and not any(ph.resets_errors and ph.first == stop + 1 for ph in phases)


# (optimizer, step to save at): before each phase and inside it (the registry's resume points);
# every run continues to the registry's last step, which communicates (the replicas agree)
CASES = [(info.name, stop) for info in OPTIMIZERS for stop in info.resume_points()]
_onebit_adam = BY_NAME["OnebitAdam"].make


def _resume(backend, path: str, name: str, stop: int, total: int):
    factory = BY_NAME[name].make
    rank = backend.rank
    model = _net(0)
    opt = factory(model.parameters())
    _train(model, opt, rank, range(stop))
    errors_nonzero = any(bool(b.abs().sum() > 0) for s in opt.flat_states for b in s.comm.values())
    commopt.save_checkpoint(path, model, opt, step=stop, rank_note=f"r{rank}")
    _train(model, opt, rank, range(stop, total))
    expected = _flat_params(model)
    expected_seen = model.seen.clone()

    fresh = _net(seed=7)
    opt2 = factory(fresh.parameters())
    extra = commopt.load_checkpoint(path, fresh, opt2)
    _train(fresh, opt2, rank, range(extra["step"], total))

    # Control: the same resume with the error buffers dropped must differ once they matter.
    control = _net(seed=7)
    opt3 = factory(control.parameters())
    commopt.load_checkpoint(path, control, opt3)
    for state in opt3.flat_states:  # laid out here, errors restored; then dropped
        state.reset_comm()
    _train(control, opt3, rank, range(stop, total))

    out = torch.empty(backend.world_size * expected.numel())
    backend.all_gather(out, expected)
    return {
        "extra": extra,
        "exact": torch.equal(expected, _flat_params(fresh)),
        "seen_exact": torch.equal(expected_seen, fresh.seen),
        "control_differs": not torch.equal(expected, _flat_params(control)),
        "errors_nonzero": errors_nonzero,
        "replicas": out.view(backend.world_size, -1),
    }


@pytest.mark.parametrize(("name", "stop"), CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_resume_bit_exact_two_ranks(tmp_path, name, stop):
    info = BY_NAME[name]
    results = run_ranks(_resume, 2, str(tmp_path / "ck"), name, stop, info.steps, timeout=TIMEOUT)
    for rank, r in enumerate(results):
        assert r["extra"] == {"step": stop, "rank_note": f"r{rank}"}
        assert r["exact"], f"rank {rank}: resumed parameters differ from uninterrupted training"
        assert r["seen_exact"], f"rank {rank}: its per-rank buffer was not restored"
        assert torch.equal(r["replicas"][0], r["replicas"][1])
        if _errors_matter(info, stop):  # the error buffers were live and must be restored
            assert r["errors_nonzero"]
            assert r["control_differs"], "dropping the error buffers did not change anything"


def _save_at(backend, path: str, stop: int):
    model = _net(0)
    opt = _onebit_adam(model.parameters())
    _train(model, opt, backend.rank, range(stop))
    commopt.save_checkpoint(path, model, opt, step=stop)
    sd = opt.state_dict()
    return {
        "params": _flat_params(model),
        "seen": model.seen.clone(),
        "exp_avg_sq": torch.cat([s["exp_avg_sq"].reshape(-1) for s in sd["state"].values()]),
        "step": opt.global_state["step"],
    }


def _load_elsewhere(backend, path: str):
    model = _net(seed=9)
    opt = _onebit_adam(model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra = commopt.load_checkpoint(path, model, opt)
    states = opt.flat_states  # laid out here: the errors are restored or reset
    errors_zero = all(bool((b == 0).all()) for s in states for b in s.comm.values())
    sd = opt.state_dict()
    loaded = {
        "params": _flat_params(model),
        "seen": model.seen.clone(),
        "exp_avg_sq": torch.cat([s["exp_avg_sq"].reshape(-1) for s in sd["state"].values()]),
        "step": opt.global_state["step"],
    }
    _train(model, opt, backend.rank, range(extra["step"], extra["step"] + 2))
    out = torch.empty(backend.world_size * loaded["params"].numel())
    backend.all_gather(out, _flat_params(model))
    return {
        "warnings": [str(w.message) for w in caught],
        "errors_zero": errors_zero,
        "loaded": loaded,
        "replicas": out.view(backend.world_size, -1),
    }


def test_resume_at_another_world_size(tmp_path):
    path = str(tmp_path / "ck")
    saved = run_ranks(_save_at, 2, path, 5, timeout=TIMEOUT)
    assert not torch.equal(saved[0]["seen"], saved[1]["seen"])  # a genuinely per-rank tensor
    results = run_ranks(_load_elsewhere, 3, path, timeout=TIMEOUT)
    for r in results:
        assert any(
            "saved at world size 2 and is loaded at 3: the per-rank error buffers are reset to "
            "zero, 1 tensor(s) that differed between ranks are taken from rank 0's shard" in w
            for w in r["warnings"]
        ), r["warnings"]
        assert r["errors_zero"]
        assert torch.equal(r["loaded"]["params"], saved[0]["params"])
        assert torch.equal(r["loaded"]["exp_avg_sq"], saved[0]["exp_avg_sq"])
        assert torch.equal(r["loaded"]["seen"], saved[0]["seen"])  # rank 0's copy everywhere
        assert r["loaded"]["step"] == 5
        assert all(torch.equal(r["replicas"][0], row) for row in r["replicas"])


def _load_with_one_bad_rank(backend, path: str):
    import commopt.checkpoint as ck

    if backend.rank == 1:  # only rank 1 sees a damaged shard
        real = ck._file_digest
        ck._file_digest = lambda p: ("0" * 64, real(p)[1])
    model = _net(seed=9)
    opt = _onebit_adam(model.parameters())
    before = _flat_params(model)
    try:
        commopt.load_checkpoint(path, model, opt)
    except CheckpointError as err:
        return {"message": str(err), "unchanged": torch.equal(before, _flat_params(model))}
    return {"message": None}


def test_a_failure_on_one_rank_is_raised_on_every_rank(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(_save_at, 2, path, 2, timeout=TIMEOUT)
    results = run_ranks(_load_with_one_bad_rank, 2, path, timeout=TIMEOUT)
    assert "failed on rank(s) [1]" in results[0]["message"]
    assert "is corrupt" in results[1]["message"]
    assert results[0]["unchanged"] and results[1]["unchanged"]


def _uneven_state(backend, path: str):
    model = _net(0)
    opt = _onebit_adam(model.parameters())
    _train(model, opt, backend.rank, range(2))
    if backend.rank == 1:  # state that exists on one rank only
        opt.state[model.a.weight]["only_here"] = torch.full((2,), 7.0)
    commopt.save_checkpoint(path, model, opt)
    fresh = _net(seed=3)
    opt2 = _onebit_adam(fresh.parameters())
    commopt.load_checkpoint(path, fresh, opt2)
    return {
        "has": "only_here" in opt2.state[fresh.a.weight],
        "exp_avg": torch.equal(
            opt.state[model.a.weight]["exp_avg"], opt2.state[fresh.a.weight]["exp_avg"]
        ),
    }


def test_state_present_on_some_ranks_only_is_saved_per_rank(tmp_path):
    results = run_ranks(_uneven_state, 2, str(tmp_path / "ck"), timeout=TIMEOUT)
    assert [r["has"] for r in results] == [False, True]
    assert all(r["exp_avg"] for r in results)


def _save_bad_extra_on_rank_1(backend, path: str):
    import numpy as np

    model = _net(0)
    opt = _onebit_adam(model.parameters())
    _train(model, opt, backend.rank, range(2))
    commopt.save_checkpoint(path, model, opt, step=2)
    _train(model, opt, backend.rank, range(2, 4))
    bad = {"loss": np.float32(0.25)} if backend.rank == 1 else {"loss": 0.25}
    try:
        commopt.save_checkpoint(path, model, opt, step=4, **bad)
    except CheckpointError as err:
        message = str(err)
    else:
        message = None
    fresh = _net(seed=3)
    return {
        "message": message,
        "extra": commopt.load_checkpoint(path, fresh, _onebit_adam(fresh.parameters())),
    }


def test_an_unloadable_extra_on_one_rank_is_refused_on_every_rank(tmp_path):
    # issue #15.5: refused before anything is written, on every rank; the old checkpoint stays.
    results = run_ranks(_save_bad_extra_on_rank_1, 2, str(tmp_path / "ck"), timeout=TIMEOUT)
    assert "rank(s) [1] refused" in results[0]["message"]
    assert "extra['loss'] is a numpy.float32" in results[1]["message"]
    assert all("was left as it was" in r["message"] for r in results)
    assert [r["extra"] for r in results] == [{"step": 2}, {"step": 2}]


def _train_sitting_out(model, opt, rank: int, steps: range) -> None:
    """``_train``, with layer b's bias sitting out every third step on every rank."""
    for t in steps:
        model.b.bias.requires_grad_(t % 3 != 2)
        _train(model, opt, rank, range(t, t + 1))
    model.b.bias.requires_grad_(True)


def _resume_sitting_out(backend, path: str, name: str, stop: int, total: int):
    factory = BY_NAME[name].make
    model = _net(0)
    opt = factory(model.parameters())
    _train_sitting_out(model, opt, backend.rank, range(stop))
    counted = dict(opt.state[model.b.bias])
    commopt.save_checkpoint(path, model, opt)
    _train_sitting_out(model, opt, backend.rank, range(stop, total))
    fresh = _net(seed=7)
    opt2 = factory(fresh.parameters())
    commopt.load_checkpoint(path, fresh, opt2)
    loaded = dict(opt2.state[fresh.b.bias])
    _train_sitting_out(fresh, opt2, backend.rank, range(stop, total))
    idle = {k: v for k, v in counted.items() if "idle" in k}
    return (
        idle,
        {k: loaded.get(k) for k in idle},
        torch.equal(_flat_params(model), _flat_params(fresh)),
    )


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_the_steps_a_parameter_sat_out_are_saved_and_resumed(tmp_path, info):
    # Each parameter's count of the steps it sat out (state[p]["idle_steps"], a plain int in
    # its state) goes through save_checkpoint / load_checkpoint like the tensors: bit-exact.
    stop = info.steps // 2 + 1
    results = run_ranks(
        _resume_sitting_out, 2, str(tmp_path / "ck"), info.name, stop, info.steps, timeout=TIMEOUT
    )
    for idle, loaded, exact in results:
        assert exact
        assert loaded == idle
        if (
            "bias_correction"
            in BY_NAME[info.name].make([torch.nn.Parameter(torch.ones(1))]).defaults
        ):
            assert idle.get("idle_steps", 0) > 0
