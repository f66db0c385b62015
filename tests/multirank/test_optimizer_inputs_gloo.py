"""Issue #15's optimizer items on 2 forked gloo ranks: gradients missing on some or all ranks,
non-finite values reaching an exchange, another rank's state dict, a group added on one rank."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from commopt import OnebitAdam, OnebitLamb, ZeroOneAdam
from tests.multirank.harness import RankError, run_ranks
from tests.optim_registry import BY_NAME

TIMEOUT = 120.0


def _gathered(backend, t: torch.Tensor) -> list[torch.Tensor]:
    out = torch.empty(backend.world_size * t.numel())
    backend.all_gather(out, t.reshape(-1).float().contiguous())
    return list(out.view(backend.world_size, -1))


def _missing_gradients(backend, cls_name: str):
    info = BY_NAME[cls_name]
    torch.manual_seed(0)
    w, some, none = (torch.nn.Parameter(torch.randn(6)) for _ in range(3))
    none_before = none.detach().clone()
    group = {"params": [w, some, none], "weight_decay": 0.1}
    opt = info.make([group], freeze=3, lr=0.05, backend=backend)
    for t in range(8):
        opt.zero_grad()
        ((w - t) ** 2).sum().backward()
        if backend.rank == 0:  # `some` has a gradient on rank 0 only: rank 1 counts it as 0
            some.grad = torch.full_like(some, 0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
    return {
        "none_unchanged": torch.equal(none, none_before),
        "some_moved": not torch.equal(some.detach(), none_before),
        "replicas": [_gathered(backend, info.shared(opt, [p], freeze=3)) for p in (w, some)],
    }


@pytest.mark.parametrize("cls_name", list(BY_NAME))
def test_gradient_missing_everywhere_is_skipped_missing_on_one_rank_is_zero(cls_name):
    for res in run_ranks(_missing_gradients, 2, cls_name, timeout=TIMEOUT):
        assert res["none_unchanged"]
        for rows in res["replicas"]:
            assert torch.equal(rows[0], rows[1])


def _lamb_overflow(backend):
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0, 0.5]))
    opt = OnebitLamb([w], lr=0.01, freeze_step=2, backend=backend)
    for _ in range(3):
        opt.zero_grad()
        (w**2).sum().backward()
        opt.step()
    before = {k: v.clone() for k, v in opt.state[w].items()}
    p_before = w.detach().clone()
    errors = [b.clone() for s in opt.flat_states for b in s.comm.values()]
    opt.zero_grad()
    (w**2).sum().backward()
    if backend.rank == 1:  # finite gradient, but σ·m overflows fp32 on this rank only
        w.grad.fill_(3e38)
        opt.state[w]["scaling_coeff"].fill_(1e10)
        before["scaling_coeff"] = opt.state[w]["scaling_coeff"].clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    return {
        "warned": any("non-finite values to exchange" in str(c.message) for c in caught),
        "step": opt.global_state["step"],
        "params_same": torch.equal(w, p_before),
        "state_same": all(torch.equal(v, before[k]) for k, v in opt.state[w].items()),
        "errors_same": all(
            torch.equal(a, b)
            for a, b in zip(
                errors, [b for s in opt.flat_states for b in s.comm.values()], strict=True
            )
        ),
    }


def test_lamb_non_finite_momentum_on_one_rank_skips_everywhere_with_nothing_changed():
    for res in run_ranks(_lamb_overflow, 2, timeout=TIMEOUT):
        assert res == {
            "warned": True,
            "step": 3,
            "params_same": True,
            "state_same": True,
            "errors_same": True,
        }


def _zero_one_diverged_replica(backend):
    torch.manual_seed(1)
    w = torch.nn.Parameter(torch.randn(8))
    opt = ZeroOneAdam([w], lr=0.01, var_freeze_step=2, local_step_clipper=2, backend=backend)
    synced = None
    for t in range(1, 9):
        opt.zero_grad()
        (w**2).sum().backward()
        if t == 5 and backend.rank == 0:
            w.data[0] = float("inf")  # this replica diverged between syncs
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        if t == 4:
            synced = w.detach().clone()
        if t == 5:  # every phase-B step is a sync here (local_interval stays 1)
            after_bad_sync = w.detach().clone()
            warned = any("returns to the last synced" in str(c.message) for c in caught)
    return {
        "back_to_sync": torch.equal(after_bad_sync, synced),
        "warned": warned,
        "finite": bool(torch.isfinite(w).all()),
        "replicas": _gathered(backend, w.detach()),
    }


def test_zero_one_sync_with_a_diverged_replica_returns_every_rank_to_the_synced_point():
    for res in run_ranks(_zero_one_diverged_replica, 2, timeout=TIMEOUT):
        assert res["back_to_sync"] and res["warned"] and res["finite"]
        assert torch.equal(res["replicas"][0], res["replicas"][1])


def _zero_one_nonfinite_sync_point(backend, overlap: bool):
    # Issue #41.4: a weight already inf when phase B began made every sync return to an inf
    # p_sync, at every sync, warning each time the same "returns to the last synced" message.
    torch.manual_seed(1)
    w = torch.nn.Parameter(torch.randn(8))
    opt = ZeroOneAdam(
        [w], lr=0.01, var_freeze_step=2, local_step_clipper=2, backend=backend, overlap=overlap
    )
    for t in range(1, 9):
        opt.zero_grad()
        (w * torch.arange(8.0)).sum().backward()  # a finite gradient whatever w holds
        if t == 1 and backend.rank == 0:
            w.data[0] = float("inf")
        try:
            opt.step()
        except RuntimeError as err:
            return t, str(err)
    return None


@pytest.mark.parametrize("overlap", [False, True])
def test_zero_one_sync_point_that_is_not_finite_raises_on_every_rank(overlap):
    results = run_ranks(_zero_one_nonfinite_sync_point, 2, overlap, timeout=TIMEOUT)
    assert results[0] == results[1] and results[0] is not None, results
    step, message = results[0]
    assert step == 3, results  # the first sync: phase B's first step
    assert "ZeroOneAdam: step 3 is a sync" in message and "on rank(s) [0]" in message, message
    assert "returning there cannot recover" in message, message


def _foreign_state_dict(backend):
    w = torch.nn.Parameter(torch.arange(6.0))
    opt = OnebitAdam([w], lr=0.01, freeze_step=1, backend=backend)
    for _ in range(3):
        opt.zero_grad()
        (w**2).sum().backward()
        opt.step()
    # every rank loads rank 0's dict, as `if rank == 0: torch.save(opt.state_dict())` users do
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).clone()
    size = torch.tensor([data.numel()])
    backend.broadcast(size, 0)
    payload = data if backend.rank == 0 else torch.empty(int(size), dtype=torch.uint8)
    backend.broadcast(payload, 0)
    loaded = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
    opt2 = OnebitAdam([torch.nn.Parameter(w.detach().clone())], freeze_step=1, backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt2.load_state_dict(loaded)
        states = opt2.flat_states
    mine = [b for s in opt.flat_states for b in s.comm.values()]
    got = [b for s in states for b in s.comm.values()]
    return {
        "warned": [str(c.message) for c in caught if "error-feedback" in str(c.message)],
        "zeros": all(bool((b == 0).all()) for b in got),
        "own": all(torch.equal(a, b) for a, b in zip(mine, got, strict=True)),
    }


def test_another_ranks_state_dict_resets_the_error_buffers_with_one_warning():
    r0, r1 = run_ranks(_foreign_state_dict, 2, timeout=TIMEOUT)
    assert r0["own"] and not r0["warned"]
    assert r1["zeros"] and len(r1["warned"]) == 1
    assert "saved by rank 0, loaded on rank 1" in r1["warned"][0]


def _group_on_one_rank(backend):
    w = torch.nn.Parameter(torch.ones(4))
    opt = OnebitAdam([w], lr=0.01, freeze_step=5, backend=backend)
    opt.zero_grad()
    w.sum().backward()
    opt.step()
    if backend.rank == 1:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})
    opt.zero_grad()
    w.sum().backward()
    opt.step()


def test_group_added_on_one_rank_only_fails_cleanly_on_every_rank():
    """#15.4/#15.10: it used to abort inside gloo during warmup (gloo::EnforceNotMet)."""
    with pytest.raises(RankError) as info:
        run_ranks(_group_on_one_rank, 2, timeout=TIMEOUT)
    for message in info.value.messages:
        assert message is not None and "parameter count differs between ranks" in message
