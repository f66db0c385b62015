"""Uneven inputs under torch's ``Join`` (``commopt.join``), on forked gloo ranks.

Rank 1 runs out of data after ``SHORT`` (or 0) of ``STEPS`` batches. Inside ``Join([optimizer])``
(``Join([ddp_model, optimizer])`` under DDP, with ``commopt.ddp.register_hook``) it shadows the
others' steps, and the run must end bit for bit where a run ends in which rank 1 kept stepping
on zero gradients (``loss * 0``): DDP's meaning of a joined rank; and the next epoch, with data
on every rank, goes on from there alike. For DiLoCo the joined rank takes no inner step and
joins every sync with what it trained. Before, the ranks aborted in gloo or hung: the
optimizer's collectives in ``step()`` had nothing to meet them on the joined rank.
"""

from __future__ import annotations

import contextlib
import hashlib
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

import commopt
from tests.multirank.harness import run_ranks
from tests.optim_registry import OPTIMIZERS, make_model

TIMEOUT = 120.0
STEPS, SHORT, FREEZE = 12, 7, 3
MODES = ("standalone", "ddp-hook", "overlap", "hierarchical", "econtrol")


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _build(backend, name: str, mode: str, net: torch.nn.Module | None = None, **ddp: bool):
    net = net or make_model()
    model = DistributedDataParallel(net, **ddp) if mode == "ddp-hook" else net
    if mode == "hierarchical":  # nodes of two ranks, faked through the env
        os.environ.update(
            LOCAL_RANK=str(backend.rank % 2),
            LOCAL_WORLD_SIZE="2",
            GROUP_RANK=str(backend.rank // 2),
        )
    if name == "DiLoCo":
        topology = "hierarchical" if mode == "hierarchical" else "flat"
        inner = torch.optim.Adam(model.parameters(), lr=1e-2)
        opt = commopt.DiLoCo(inner, sync_every=3, topology=topology)
    else:
        info = next(i for i in OPTIMIZERS if i.name == name)
        opt = info.make(model.parameters(), mode=mode, freeze=FREEZE, backend=backend)
    if mode == "ddp-hook":
        commopt.ddp.register_hook(model, opt)
    return model, opt


def _step(opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    loss.backward()
    opt.step()
    opt.zero_grad()


def _result(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """The model's digest, once DiLoCo has synced what each rank trained since its last sync."""
    if isinstance(opt, commopt.DiLoCo):
        opt.finish()
    return _digest(model)


def _batch(model: torch.nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    x = torch.randn(4, next(model.parameters()).shape[1], generator=g)
    return model(x).square().mean()


def _uneven(backend, name: str, mode: str, short: int, joined: bool) -> str:
    """Rank 1 has ``short`` batches. ``joined``: it stops there, inside Join; else it goes on
    with no data of its own: zero gradients (``loss * 0``), or, for DiLoCo, none at all (after
    the backward that DDP's collectives need)."""
    model, opt = _build(backend, name, mode)
    mine = short if joined and dist.get_rank() == 1 else STEPS
    joinables = ([model] if mode == "ddp-hook" else []) + [opt]
    with Join(joinables) if joined else contextlib.nullcontext():
        for step in range(mine):
            loss = _batch(model, step)
            out_of_data = dist.get_rank() == 1 and step >= short
            (loss * 0 if out_of_data else loss).backward()
            if out_of_data and name == "DiLoCo":
                opt.zero_grad()  # the inner optimizer takes no step
            opt.step()
            opt.zero_grad()
    for step in range(STEPS, STEPS + 2):  # the next epoch: every rank has data again
        _step(opt, _batch(model, step))
    return _result(model, opt)


@pytest.mark.parametrize(
    ("name", "mode"),
    [(i.name, mode) for i in OPTIMIZERS for mode in MODES]
    # (overlap and error feedback are options of commopt's optimizers, not of DiLoCo's)
    + [("DiLoCo", mode) for mode in ("standalone", "ddp-hook", "hierarchical")],
)
@pytest.mark.parametrize("short", [SHORT, 0])  # (0: a rank without a batch, from the start)
def test_a_joined_rank_shadows_the_steps_as_a_rank_with_zero_gradients(name, mode, short) -> None:
    world = 4 if mode == "hierarchical" else 2
    joined = run_ranks(_uneven, world, name, mode, short, True, timeout=TIMEOUT)
    zeros = run_ranks(_uneven, world, name, mode, short, False, timeout=TIMEOUT)
    assert joined == zeros  # (0/1 Adam's replicas differ between syncs, by design)
    if name != "ZeroOneAdam":
        assert len(set(joined)) == 1


def _misuse(backend, case: str) -> str:
    model, opt = _build(backend, "OnebitAdam", "ddp-hook")
    mine = 2 if dist.get_rank() == 1 else 4
    try:
        joinables = [model] if case == "model alone" else [model, opt]
        kwargs = {"divide_by_initial_world_size": False} if case == "divide" else {}
        with Join(joinables, **kwargs):
            for step in range(mine):
                _batch(model, step).backward()
                opt.step()
                opt.zero_grad()
    except (RuntimeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_a_join_without_the_optimizer_is_a_clear_error_on_the_joined_rank() -> None:
    """DDP's ``join()`` alone shadows DDP's collectives, not the optimizer's: the joined rank
    says so (the other rank then loses its peer: gloo's error, not a hang)."""
    out = run_ranks(_misuse, 2, "model alone", timeout=TIMEOUT)
    assert out[1].startswith("RuntimeError: commopt.ddp.onebit_hook ran outside backward")
    assert "`with Join([model, optimizer]):`" in out[1]
    out = run_ranks(_misuse, 2, "divide", timeout=TIMEOUT)
    assert all("divide_by_initial_world_size=True; False" in o for o in out), out


def test_a_backend_without_a_torch_group_is_refused_by_join() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    opt = commopt.OnebitAdam([w], freeze_step=3, backend=commopt.comm.SingleProcessBackend())
    with pytest.raises(TypeError, match="torch's Join counts the joined ranks over a torch"):
        Join([opt])


class _TwoHeads(torch.nn.Module):
    """One head per step, the other unused on every rank (find_unused_parameters=True)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(6, 8)
        self.heads = torch.nn.ModuleList([torch.nn.Linear(8, 3), torch.nn.Linear(8, 3)])

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return self.heads[step % 2](self.body(x).tanh())


def _unused_heads(backend, name: str, short: int) -> str:
    model, opt = _build(backend, name, "ddp-hook", _TwoHeads(), find_unused_parameters=True)
    with Join([model, opt]):
        for step in range(short if dist.get_rank() == 1 else STEPS):
            g = torch.Generator().manual_seed(100 * step + dist.get_rank())
            _step(opt, model(torch.randn(4, 6, generator=g), step).square().mean())
    return _result(model, opt)


@pytest.mark.parametrize(
    "name", [i.name for i in OPTIMIZERS if i.name != "ZeroOneAdam"] + ["DiLoCo"]
)
def test_with_parameters_unused_on_every_rank_the_replicas_still_agree(name) -> None:
    """DDP's join counts a parameter no rank used as used (zeros in its p.grad, as with
    torch.optim.Adam: docs/ddp.md), so this is not the zero-gradient run bit for bit; but the
    ranks meet in every collective and end with one model. (0/1 Adam's replicas differ between
    syncs by design.)"""
    for short in (0, SHORT):
        digests = run_ranks(_unused_heads, 2, name, short, timeout=TIMEOUT)
        assert digests[0] == digests[1], short
