"""PyTorch's own DiLoCo (``torchft.local_sgd.DiLoCo``) as a row of the convergence runs.

    pip install torchft==0.2.0     # not a commopt dependency; only this peer row needs it
    python -m experiments.diloco.convergence --task digits --seeds 0,1,2 \\
        --optimizers DiLoCo-none-H10,DiLoCo-torchft-H10,DiLoCo-none-H50,DiLoCo-torchft-H50

Label ``DiLoCo-torchft-HK[-oR][-nesterov|-plain]``: torchft's DiLoCo around the same inner Adam
as the ``DiLoCo-*`` rows of :mod:`experiments.harness.training`, with the outer
``torch.optim.SGD`` that commopt's ``"none"`` row uses at the same label (commopt's defaults,
lr 1.3 and no momentum; ``-nesterov`` the paper's 0.7/0.9; ``-plain`` lr 1). Each rank is one
torchft replica group of one rank: a ``TCPStore`` of its own, a ``Manager`` over torchft's
``ProcessGroupGloo`` with synchronous quorums, and rank 0 runs the ``LighthouseServer`` whose
address it broadcasts. torchft all-reduces the fp32 pseudo-gradients itself (its
``should_quantize`` is CUDA-only), so the bytes are modelled as for commopt's ``"none"``:
2·(n−1)/n·4L per sync.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["TorchftDiLoCo", "is_torchft_label"]

_LABEL = re.compile(
    r"DiLoCo-torchft-H(?P<h>\d+)(?:-o(?P<olr>[\d.]+))?(?:-(?P<outer>nesterov|plain))?"
)


def is_torchft_label(label: str) -> bool:
    """Whether ``label`` names this peer row (module docstring)."""
    return _LABEL.fullmatch(label) is not None


class _Bytes:
    """The byte counter :class:`experiments.harness.training.Setup` reads (``stats``)."""

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.calls = 0


class TorchftDiLoCo:
    """torchft's DiLoCo on this rank, driven like an optimizer: ``step``, ``zero_grad``,
    ``finish``. Build it on every rank of an initialised gloo world, with the same label."""

    def __init__(self, label: str, model: nn.Module, lr: float, betas: Any, weight_decay: float):
        try:
            from torchft import Manager, ProcessGroupGloo
            from torchft.coordination import LighthouseServer
            from torchft.local_sgd import DiLoCo
        except ImportError as e:
            raise ImportError(
                f"{label} is PyTorch's torchft DiLoCo, which commopt does not install: "
                "pip install torchft==0.2.0"
            ) from e

        m = _LABEL.fullmatch(label)
        if m is None:
            raise ValueError(f"not a torchft label: {label!r}")
        outer_lr, momentum = {"nesterov": (0.7, 0.9), "plain": (1.0, 0.0)}.get(
            m["outer"] or "", (1.3, 0.0)
        )
        if m["olr"]:
            outer_lr = float(m["olr"])
        rank, n = dist.get_rank(), dist.get_world_size()
        self._lighthouse = LighthouseServer(bind="[::]:0", min_replicas=n) if rank == 0 else None
        address = [self._lighthouse.address() if self._lighthouse else None]
        dist.broadcast_object_list(address, src=0)
        timeout = timedelta(seconds=120)
        self._store = dist.TCPStore("localhost", 0, 1, True, timeout=timeout)
        self.inner = torch.optim.Adam(
            model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay
        )
        outer = torch.optim.SGD(
            model.parameters(), lr=outer_lr, momentum=momentum, nesterov=momentum > 0
        )
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=lambda state: None,  # every rank starts from rank 0's weights
            state_dict=dict,
            min_replica_size=n,
            use_async_quorum=False,
            replica_id=f"commopt-peer-{rank}",
            store_addr="localhost",
            store_port=self._store.port,
            rank=0,
            world_size=1,
            lighthouse_addr=address[0],
            timeout=timeout,
            quorum_timeout=timeout,
        )
        self.sync_every = int(m["h"])
        self._diloco = DiLoCo(self.manager, [model], self.inner, outer, sync_every=self.sync_every)
        self._diloco.__enter__()
        self.param_groups = self.inner.param_groups
        self.stats = _Bytes()
        self._numel = sum(p.numel() for p in model.parameters())
        self._n, self._steps = n, 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """An inner step; torchft's hook on it syncs every ``sync_every`` steps."""
        self.inner.step()
        self._steps += 1
        if self._steps % self.sync_every == 0:
            self.stats.bytes_sent += 2 * (self._n - 1) * 4 * self._numel // self._n
            self.stats.calls += 1

    def finish(self) -> None:
        """Leave torchft's DiLoCo and shut its manager and lighthouse down (every rank)."""
        self._diloco.__exit__(None, None, None)
        dist.barrier()  # no replica leaves while another still talks to it
        self.manager.shutdown(wait=False)
        if self._lighthouse is not None:
            self._lighthouse.shutdown()
