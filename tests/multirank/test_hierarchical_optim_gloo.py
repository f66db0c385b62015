"""The optimizers with topology="hierarchical" on 4 forked gloo ranks faking nodes through the env.

Replicas stay bit-identical; with one rank per node the hierarchical topology is exactly flat.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.multirank.harness import run_ranks
from tests.optim_registry import BY_NAME, OPTIMIZERS

TIMEOUT = 120.0
STEPS = 5
#: the optimizer of the checkpoint and local-level tests, which test the exchange's state and
#: backends (the same object under every optimizer); the replica tests run every optimizer
VEHICLE = BY_NAME["OnebitAdam"]


def _fake_nodes(backend, local_size: int) -> None:
    os.environ.update(
        LOCAL_RANK=str(backend.rank % local_size),
        LOCAL_WORLD_SIZE=str(local_size),
        GROUP_RANK=str(backend.rank // local_size),
    )


def _train(backend, name: str, local_size: int, topology: str):
    """Every phase of ``name``'s test schedule on random per-rank gradients; returns what the
    replicas share at the end and the exchange's name."""
    info = BY_NAME[name]
    _fake_nodes(backend, local_size)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(37, 11)), torch.nn.Parameter(torch.randn(101))]
    opt = info.make(params, mode="hierarchical" if topology == "hierarchical" else "standalone")
    gen = torch.Generator().manual_seed(backend.rank)
    for _ in range(info.steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return info.shared(opt, params), opt.exchange.name


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_hierarchical_replicas_identical(info) -> None:
    results = run_ranks(_train, 4, info.name, 2, "hierarchical", timeout=TIMEOUT)
    assert [name for _, name in results] == [
        f"hierarchical:2x2:{i}.{j}" for i in (0, 1) for j in (0, 1)
    ]
    for shared, _ in results:
        assert torch.equal(shared, results[0][0])
    flat = run_ranks(_train, 4, info.name, 2, "flat", timeout=TIMEOUT)
    # Different averages (the hierarchical one is exact inside a node), same replicas property.
    assert not torch.equal(flat[0][0], results[0][0])


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_one_rank_per_node_is_flat(info) -> None:
    hier = run_ranks(_train, 4, info.name, 1, "hierarchical", timeout=TIMEOUT)
    flat = run_ranks(_train, 4, info.name, 1, "flat", timeout=TIMEOUT)
    assert {name for _, name in hier} == {"flat"}
    for (h, _), (f, _) in zip(hier, flat, strict=True):
        assert torch.equal(h, f)


def _resume(backend, topology_after: str):
    _fake_nodes(backend, 2)
    import warnings

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(37, 11))]
    opt = VEHICLE.make(params, mode="hierarchical", freeze=2)
    gen = torch.Generator().manual_seed(backend.rank)
    for _ in range(STEPS):
        params[0].grad = torch.randn(params[0].shape, generator=gen)
        opt.step()
    sd = opt.state_dict()
    again = VEHICLE.make(
        [torch.nn.Parameter(params[0].detach().clone())], freeze=2, topology=topology_after
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again.load_state_dict(sd)
        states = again.flat_states
    mine = [b for s in opt.flat_states for b in s.comm.values()]
    got = [b for s in states for b in s.comm.values()]
    return {
        "saved_exchange": sd["commopt"]["exchange"],
        "warned": [str(c.message) for c in caught if "error-feedback" in str(c.message)],
        "restored": len(mine) == len(got)
        and all(torch.equal(a, b) for a, b in zip(mine, got, strict=True)),
        "zeros": all(bool((b == 0).all()) for b in got),
    }


def test_checkpoint_records_the_topology_and_a_change_resets_the_errors() -> None:
    """#16.3: the same topology restores this rank's (slice-sized) errors exactly; another
    topology follows the world-size-change policy: errors reset to zero with one warning."""
    for res in run_ranks(_resume, 4, "hierarchical", timeout=TIMEOUT):
        assert res["saved_exchange"].startswith("hierarchical:2x2:")
        assert res["restored"] and not res["warned"]
    for res in run_ranks(_resume, 4, "flat", timeout=TIMEOUT):
        assert res["zeros"] and len(res["warned"]) == 1
        assert "saved for the 'hierarchical:2x2:" in res["warned"][0]


# -- the local level the optimizers get ------------------------------------------------------------
def _train_levels(backend, setting: str | None, resume_setting: str | None):
    """Train with COMMOPT_SHARED_MEMORY=setting, checkpoint after 3 steps, resume under
    resume_setting and take the remaining steps; also report what topology='auto' builds."""
    _fake_nodes(backend, 2)
    import warnings

    from commopt.comm.shm_backend import SharedMemoryBackend

    def set_env(value: str | None) -> None:
        if value is None:
            os.environ.pop("COMMOPT_SHARED_MEMORY", None)
        else:
            os.environ["COMMOPT_SHARED_MEMORY"] = value

    set_env(setting)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(37, 11)), torch.nn.Parameter(torch.randn(101))]
    opt = VEHICLE.make(params, mode="hierarchical", freeze=2)
    auto = VEHICLE.make([torch.nn.Parameter(torch.zeros(3))], topology="auto")
    auto_kind = type(auto.exchange).__name__
    gen = torch.Generator().manual_seed(backend.rank)
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(STEPS)]
    for k in range(3):
        for p, g in zip(params, grads[k], strict=True):
            p.grad = g
        opt.step()
    first_level = type(opt.exchange.local_backend).__name__
    sd = opt.state_dict()
    set_env(resume_setting)
    again = VEHICLE.make(
        [torch.nn.Parameter(p.detach().clone()) for p in params], mode="hierarchical", freeze=2
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again.load_state_dict(sd)
        for k in range(3, STEPS):
            for p, g in zip(again.param_groups[0]["params"], grads[k], strict=True):
                p.grad = g
            again.step()
    set_env(None)
    resumed_level = type(again.exchange.local_backend).__name__
    assert isinstance(opt.exchange.local_backend, SharedMemoryBackend) == (setting != "0")
    return {
        "levels": (first_level, resumed_level),
        "auto": auto_kind,
        "name": sd["commopt"]["exchange"],
        "warned": [str(c.message) for c in caught],
        "params": [p.detach().clone() for p in again.param_groups[0]["params"]],
    }


def test_optimizers_get_the_shared_memory_local_level_and_resume_across_levels() -> None:
    """#16 item 3: topology='hierarchical' on gloo puts the local level on shared memory by
    default (COMMOPT_SHARED_MEMORY=0 turns it off); the level only moves bytes, so the
    checkpoint (which records the exchange's name, not its level backends) resumes under the
    other level without a warning and the run continues bit for bit. topology='auto' uses flat
    when the local level would be gloo over TCP loopback."""
    runs = {
        "shm, resumed shm": run_ranks(_train_levels, 4, None, None, timeout=TIMEOUT),
        "gloo, resumed gloo": run_ranks(_train_levels, 4, "0", "0", timeout=TIMEOUT),
        "shm, resumed gloo": run_ranks(_train_levels, 4, None, "0", timeout=TIMEOUT),
    }
    expect = {
        "shm, resumed shm": ("SharedMemoryBackend", "SharedMemoryBackend", "HierarchicalExchange"),
        "gloo, resumed gloo": ("TorchBackend", "TorchBackend", "FlatExchange"),
        "shm, resumed gloo": ("SharedMemoryBackend", "TorchBackend", "HierarchicalExchange"),
    }
    reference = runs["shm, resumed shm"][0]["params"]
    for what, results in runs.items():
        for rank, res in enumerate(results):
            assert (*res["levels"], res["auto"]) == expect[what], what
            assert res["name"] == f"hierarchical:2x2:{rank // 2}.{rank % 2}"
            assert res["warned"] == [], (what, res["warned"])
            for a, b in zip(res["params"], reference, strict=True):
                assert torch.equal(a, b), what
