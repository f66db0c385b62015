r"""Uneven inputs: torch's ``Join`` context manager for commopt's optimizers and DiLoCo.

When one rank runs out of data before the others, the others' next collective waits for it for
ever (NCCL) or pairs with something else (gloo aborts). torch's answer is
``torch.distributed.algorithms.join.Join``: a rank that has run out *joins*, and shadows the
collectives of every iteration the others still run, through a hook of each *joinable* object.
DDP is one; it shadows its gradient all-reduce with zero gradients. A commopt optimizer
communicates in ``step()`` too (agreement on the gradients, the 1-bit exchange, DiLoCo's syncs),
so it is a joinable as well, as torch's ``ZeroRedundancyOptimizer`` is::

    with Join([ddp_model, optimizer]):  # or Join([optimizer]) without DDP
        for x, y in loader:              # fewer batches on some ranks
            loss_fn(ddp_model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()

A joined rank's shadow of one iteration is the optimizer's own ``step()`` on zero gradients,
exactly what DDP's shadow contributes. So the joined rank takes the same step as the others, with
the same collectives, and keeps the same parameters and state: the ranks leave the context in
step, and the next epoch's ``Join`` starts from one model. DiLoCo's shadow step has no gradient
at all: its inner optimizer takes no step, and the rank joins every sync with what it trained on
its own data. The average is over every rank, joined ones included, as DDP's default
``divide_by_initial_world_size=True``; ``False`` is refused.
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook, _JoinConfig
from torch.utils.weak import WeakIdKeyDictionary

from commopt.comm import Backend, MixedBackend, TorchBackend

__all__ = [
    "JOIN_DEVICE",
    "JOIN_PROCESS_GROUP",
    "ShadowStep",
    "disabled_join_config",
    "in_backward",
    "in_join",
    "notify",
    "set_gradients_as_ddp",
    "shadow_on_zero_gradients",
    "shadow_without_gradients",
]

# True while a joined rank's optimizer runs its shadow step (its own step() must not tell the
# context manager that the rank still has data)
_shadowing: contextvars.ContextVar[bool] = contextvars.ContextVar("commopt_join", default=False)
# the gradients commopt's DDP hook set in the current shadow iteration (set_gradients_as_ddp)
_ddp_wrote: WeakIdKeyDictionary = WeakIdKeyDictionary()


class ShadowStep(JoinHook):
    """A joined rank's part in each iteration the other ranks still run: ``optimizer.step()``
    with no data of the rank's own.

    Args:
        optimizer: a commopt optimizer or :class:`~commopt.DiLoCo`.
        zero_gradients: step on zero gradients (every parameter that requires one); False: on
            none (``p.grad`` unset).
        divide_by_initial_world_size: torch's ``Join`` keyword (DDP's); only True, the default,
            is what the optimizer computes: the average over every rank, joined ones at zero.

    Raises:
        ValueError: ``divide_by_initial_world_size=False``, or an optimizer on FSDP2 shards.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        zero_gradients: bool,
        divide_by_initial_world_size: bool = True,
    ) -> None:
        if not divide_by_initial_world_size:
            raise ValueError(
                f"{type(optimizer).__name__} averages over every rank, a joined rank's zero "
                "gradient included, as DDP's default divide_by_initial_world_size=True; False "
                "(divide by the ranks still training) has no commopt form: leave it True"
            )
        if getattr(optimizer, "sharding", None) is not None or getattr(optimizer, "sharded", False):
            raise ValueError(
                f"{type(optimizer).__name__} steps FSDP2 shards, and FSDP2 is no joinable: a "
                "joined rank could shadow the optimizer's collectives but not FSDP2's "
                "all-gathers and reduce-scatters in forward and backward. Give every rank the "
                "same number of batches (DistributedSampler(drop_last=True))"
            )
        super().__init__()
        self.optimizer = optimizer
        self.zero_gradients = zero_gradients

    def main_hook(self) -> None:
        """One shadow step: no data of this rank's own, every collective of the step."""
        token = _shadowing.set(True)
        try:
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None and p.grad in _ddp_wrote:
                        continue  # what DDP's shadow of this iteration left there (ddp.py)
                    # not this rank's last batch again
                    p.grad = (
                        torch.zeros_like(p) if self.zero_gradients and p.requires_grad else None
                    )
            self.optimizer.step()
            # as after the loop's own zero_grad: the next epoch's first backward must not add
            # to the shadow's gradients
            self.optimizer.zero_grad(set_to_none=True)
        finally:
            _ddp_wrote.clear()
            _shadowing.reset(token)


def set_gradients_as_ddp(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """On a joined rank, ``p.grad = g`` where DDP writes a rank's gradients after backward (the
    bucket's average, or the local gradient: zero), which DDP's shadow of a backward does not:
    the shadow step then steps on them, as the other ranks step on theirs."""
    for p, g in zip(params, grads, strict=True):
        p.grad = g
        _ddp_wrote[g] = True


def disabled_join_config() -> Any:
    """A joinable's ``_join_config`` outside any ``Join`` (torch's own starting value)."""
    return _JoinConfig.construct_disabled_join_config()


def in_join(joinable: Any) -> bool:
    """Whether ``joinable`` was handed to a ``Join`` context manager (torch sets its config)."""
    return bool(joinable._join_config.enable)


def in_backward() -> bool:
    """Whether an autograd backward pass is running on this thread. A DDP communication hook
    runs outside one only on a joined rank, where DDP's join hook shadows a backward."""
    return torch._C._current_graph_task_id() != -1


def notify(joinable: Any) -> None:
    """``Join.notify_join_context(joinable)`` on a rank that still has data: at the top of each
    ``step()`` (it counts this rank as not joined where the optimizer is the first joinable;
    nothing outside ``Join``, and nothing in a shadow step)."""
    if not _shadowing.get():
        Join.notify_join_context(joinable)


# torch's Joinable protocol, given to CompressedOptimizer and DiLoCo as class attributes (both
# have param_groups and a backend); Join reads these three and sets _join_config


def shadow_on_zero_gradients(self: Any, **kwargs: Any) -> ShadowStep:
    """A joined rank's shadow of each step the other ranks still take, on zero gradients:
    DDP's contribution of a joined rank (:class:`ShadowStep`)."""
    return ShadowStep(self, True, **kwargs)


def shadow_without_gradients(self: Any, **kwargs: Any) -> ShadowStep:
    """A joined rank's shadow of each step the other ranks still take, without gradients:
    DiLoCo's inner optimizer takes no step, and the rank's syncs send what it trained on its
    own data (:class:`ShadowStep`)."""
    return ShadowStep(self, False, **kwargs)


def _join_device(self: Any) -> torch.device:
    """Where the context manager counts the joined ranks: the parameters' device (an NCCL
    group's is a GPU)."""
    first = next((p for g in self.param_groups for p in g["params"]), None)
    return first.device if first is not None else torch.device("cpu")


def _join_process_group(self: Any) -> dist.ProcessGroup:
    """The torch process group the context manager counts the joined ranks over (the
    optimizer's; with a MixedBackend, its torch member's).

    Raises:
        TypeError: the backend has no torch process group (``MpiBackend``): ``Join`` is torch's.
    """
    backend: Backend = self.backend
    members = backend.backends.values() if isinstance(backend, MixedBackend) else [backend]
    for member in members:
        if isinstance(member, TorchBackend):
            return member.group if member.group is not None else dist.group.WORLD
    raise TypeError(
        f"{type(self).__name__}: torch's Join counts the joined ranks over a torch.distributed "
        f"process group, and this optimizer's backend is {type(backend).__name__}; give it a "
        "TorchBackend (or a MixedBackend with one), or every rank the same number of batches"
    )


JOIN_DEVICE = property(_join_device)
JOIN_PROCESS_GROUP = property(_join_process_group)
