"""``overlap=True`` next to the program's own collectives: the communication thread has a
communicator of its own (commopt/comm/channels.py), so an all-reduce of the loss between
backward and ``step()``, or a second overlapping optimizer, runs in any order around it. Before,
the two interleaved differently on each rank: a gloo abort, a hang, or a ``ValueError`` from the
exchange. Results are bitwise those of ``overlap=False`` without the extra collectives."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist

import commopt
from tests.multirank.harness import run_ranks
from tests.optim_registry import OPTIMIZERS

WORLD = 4


def _digest(params) -> str:
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    return hashlib.sha1(flat.numpy().tobytes()).hexdigest()[:16]


def _train(backend, names: tuple[str, ...], overlap: bool, user_collectives: bool) -> list[str]:
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))
    head = torch.nn.Linear(32, 3)
    infos = [next(i for i in OPTIMIZERS if i.name == n) for n in names]
    parts = [list(body.parameters()) + list(head.parameters())]
    if len(names) == 2:  # one optimizer for the body, another for the head
        parts = [list(body.parameters()), list(head.parameters())]
    opts = [
        info.make(p, backend=backend, overlap=overlap, bucket_numel=300)
        for info, p in zip(infos, parts, strict=True)
    ]
    gen = torch.Generator().manual_seed(backend.rank)
    digests = []
    for _ in range(max(i.steps for i in infos)):
        x, y = torch.randn(8, 12, generator=gen), torch.randn(8, 3, generator=gen)
        for opt in opts:
            opt.zero_grad()
        loss = torch.nn.functional.mse_loss(head(body(x)), y)
        loss.backward()
        if user_collectives:  # what training scripts do for logging, while exchanges run
            logged = loss.detach().clone()
            dist.all_reduce(logged)
            dist.all_reduce(torch.ones(1000))
            dist.barrier()
        for opt in opts:
            opt.step()
        digests.append(_digest(list(body.parameters()) + list(head.parameters())))
    return digests


#: each optimizer alone, and each beside the next one in the registry (two channels at once)
CASES = [(i.name,) for i in OPTIMIZERS] + [
    (a.name, b.name) for a, b in zip(OPTIMIZERS, OPTIMIZERS[1:] + OPTIMIZERS[:1], strict=True)
]


@pytest.mark.parametrize("names", CASES, ids=["+".join(c) for c in CASES])
def test_user_collectives_and_a_second_optimizer_around_the_thread(names) -> None:
    got = run_ranks(_train, WORLD, names, True, True, timeout=240)
    ref = run_ranks(_train, WORLD, names, False, False, timeout=240)
    assert all(g[-1] == got[0][-1] for g in got), "replicas differ after the last step"
    assert got == ref  # every rank, every step (0/1 Adam's local steps differ between ranks)


def _on_subgroup(world_backend, name: str) -> str:
    backend = commopt.TorchBackend(dist.new_group(list(range(world_backend.world_size))))
    info = next(i for i in OPTIMIZERS if i.name == name)
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError) as caught:
        info.make(list(model.parameters()), backend=backend, overlap=True)
    info.make(list(model.parameters()), backend=backend, overlap=False)  # still builds
    return str(caught.value)


@pytest.mark.parametrize("name", [i.name for i in OPTIMIZERS])
def test_overlap_on_a_backend_without_a_channel_is_refused_when_built(name) -> None:
    """A TorchBackend on a process group other than the default one cannot open a channel (a
    copy of the group needs every process of the job), so the thread would share the
    communicator with ``step()``'s own collectives: every run of 1-bit Adam with overlap on
    a sub-group of 2 ranks aborted or hung (gloo: "Is there a distributed collective
    mismatch?"). Now the optimizer refuses to be built so, on every rank."""
    for message in run_ranks(_on_subgroup, 2, name, timeout=120):
        assert f"{name}: overlap=True needs a backend that opens a communicator" in message
