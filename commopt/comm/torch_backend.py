"""torch.distributed as a commopt backend: NCCL on GPU, gloo on CPU, any process group."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from commopt.comm.base import CommStats, ReduceOp, check_equal_split
from commopt.comm.channels import current_channel
from commopt.comm.torch_compat import all_gather_flat

__all__ = ["TorchBackend", "staging_device_type"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _completes_with(work: dist.Work, out: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future that completes with ``out`` when ``work`` has (raising what ``work`` raised)."""

    def finish(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        fut.wait()
        return out

    return work.get_future().then(finish)


def staging_device_type(config: str) -> str | None:
    """The device type a CPU tensor travels through on a process group whose backend config
    (``torch.distributed.get_backend_config``) is ``config``: None where the group takes CPU
    tensors (``"cpu:gloo,cuda:gloo"``, ``"cpu:gloo,cuda:nccl"``), else its first device type
    (``"cuda:nccl"``, NCCL alone: ``"cuda"``)."""
    kinds = [pair.split(":")[0].strip() for pair in config.split(",")]
    return None if "cpu" in kinds else kinds[0]


class TorchBackend:
    """Collectives through ``torch.distributed`` on ``group`` (default: the default group).

    gloo has no ``AVG`` reduction, so ``op="avg"`` is a sum followed by a division by
    ``world_size`` on every backend, which keeps results identical whichever engine runs.

    On a group without a CPU backend (``init_process_group("nccl")``, and torch's default on a
    CUDA machine) a CPU tensor is copied to the current device, reduced or moved there, and
    copied back: commopt's agreement checks and counters are small CPU tensors, which NCCL
    refuses ("No backend type associated with device type cpu").
    """

    name = "torch"

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TorchBackend needs an initialized torch.distributed: call commopt.init() or "
                "torch.distributed.init_process_group() first"
            )
        self.group = group
        if group is not None and dist.get_rank(group) < 0:
            raise ValueError(
                f"TorchBackend: global rank {dist.get_rank()} is not a member of the given process "
                "group; create the backend only on the group's ranks"
            )
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.stats = CommStats()
        self.engine = dist.get_backend(group)
        #: the device type CPU tensors travel through (None: the group takes them)
        self.cpu_staging = staging_device_type(str(dist.get_backend_config(group)))
        # This thread's device now, not the caller's at each call: a communication thread's
        # current CUDA device is device 0 whatever its rank's is (it is per thread).
        self._staging_device: torch.device | None = None
        module = getattr(torch, self.cpu_staging or "", None)
        if module is not None and module.is_available():
            self._staging_device = torch.device(self.cpu_staging, module.current_device())
        self._channels: dict[str, dist.ProcessGroup] = {}

    def open_channel(self, name: str) -> bool:
        """Give channel ``name`` a process group of its own over the default group's ranks
        (:mod:`commopt.comm.channels`); collective: every process calls it, in the same order.
        False (nothing opened) for a backend on a sub-group: ``new_group`` would need every
        process of the job, not only this group's."""
        if name in self._channels:
            return True
        if self.group is not None and self.group != dist.group.WORLD:
            return False
        # new_group does not inherit the default group's timeout (gloo would wait 30 min): give
        # it this backend's watchdog timeout (commopt.faults.watch), when it has one.
        seconds = getattr(self, "watchdog_timeout", None)
        timeout = None if seconds is None else datetime.timedelta(seconds=seconds)
        group = dist.new_group(timeout=timeout)
        if self.engine == "gloo":
            # gloo connects a new group's pairs and returns without a barrier: a rank that has
            # returned and drops the group at once (an optimizer built and discarded) closes
            # sockets a slower peer is still handshaking on, and that peer fails. NCCL connects
            # lazily, at the first collective.
            dist.barrier(group=group)
        self._channels[name] = group
        return True

    def close_channel(self, name: str) -> None:
        """Destroy channel ``name``'s process group (local to this process; nothing may be in
        flight on it). Quietly nothing when torch.distributed is already shut down."""
        group = self._channels.pop(name, None)
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)

    def _group(self) -> dist.ProcessGroup | None:
        """The group this thread's collectives go over: its channel's, else the backend's."""
        name = current_channel()
        return self._channels.get(name, self.group) if name is not None else self.group

    def _staged(self, t: torch.Tensor, *, copy: bool = True) -> torch.Tensor:
        """``t`` itself, or for a CPU tensor on a group without a CPU backend a tensor like it
        on the device that was current when this backend was built (holding ``t``'s values when
        ``copy``)."""
        if self.cpu_staging is None or t.device.type != "cpu":
            return t
        device = self._staging_device
        if device is None:
            raise RuntimeError(
                f"TorchBackend: the process group has no CPU backend "
                f"({dist.get_backend_config(self.group)}) and no {self.cpu_staging} device is "
                "available to carry commopt's CPU tensors; initialize the group with a CPU "
                "backend too, e.g. init_process_group('cpu:gloo,cuda:nccl')"
            )
        return t.to(device) if copy else torch.empty_like(t, device=device)

    def all_reduce(self, t: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """``torch.distributed.all_reduce`` on this backend's group ("avg": the sum, then a
        division by ``world_size``)."""
        if op not in _OPS and op != "avg":
            raise ValueError(f"all_reduce: unknown op {op!r}; expected sum, avg, max or min")
        self.stats.record("all_reduce", t.numel() * t.element_size(), self.world_size)
        staged = self._staged(t)
        reduce_op = dist.ReduceOp.SUM if op == "avg" else _OPS[op]
        dist.all_reduce(staged, op=reduce_op, group=self._group())
        if op == "avg":
            staged.div_(self.world_size)
        return t if staged is t else t.copy_(staged)

    def all_reduce_async(
        self, t: torch.Tensor, op: ReduceOp = "sum"
    ) -> torch.futures.Future[torch.Tensor]:
        """:meth:`all_reduce` started in the background (``async_op=True``): the returned future
        completes with ``t`` reduced in place, with exactly the arithmetic of ``all_reduce``
        (for ``"avg"``: the sum, then a division by ``world_size`` in the future's callback).
        Not part of the :class:`~commopt.comm.Backend` contract; see
        :func:`commopt.comm.all_reduce_async`."""
        if op not in _OPS and op != "avg":
            raise ValueError(f"all_reduce: unknown op {op!r}; expected sum, avg, max or min")
        self.stats.record("all_reduce", t.numel() * t.element_size(), self.world_size)
        reduce_op = dist.ReduceOp.SUM if op == "avg" else _OPS[op]
        staged = self._staged(t)
        work = dist.all_reduce(staged, op=reduce_op, group=self._group(), async_op=True)
        n = self.world_size

        def finish(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            fut.wait()
            if op == "avg":
                staged.div_(n)
            return t if staged is t else t.copy_(staged)

        return work.get_future().then(finish)

    def all_gather_async(
        self, out: torch.Tensor, t: torch.Tensor
    ) -> torch.futures.Future[torch.Tensor]:
        """:meth:`all_gather` started in the background (``async_op=True``); the future completes
        with ``out``. See :func:`commopt.comm.all_gather_async`."""
        return self._move_async("all_gather", out, t)

    def all_to_all_async(
        self, out: torch.Tensor, t: torch.Tensor
    ) -> torch.futures.Future[torch.Tensor]:
        """:meth:`all_to_all` started in the background (``async_op=True``); the future completes
        with ``out``. See :func:`commopt.comm.all_to_all_async`."""
        return self._move_async("all_to_all", out, t)

    def _move_async(
        self, op: str, out: torch.Tensor, t: torch.Tensor
    ) -> torch.futures.Future[torch.Tensor]:
        check_equal_split(op, out, t, self.world_size)
        self.stats.record(op, t.numel() * t.element_size(), self.world_size)
        staged_out, staged = self._staged(out, copy=False), self._staged(t)
        if op == "all_gather":
            work = all_gather_flat(
                staged_out.view(-1), staged.reshape(-1), self._group(), async_op=True
            )
        else:
            work = dist.all_to_all_single(
                staged_out.view(-1), staged.reshape(-1), group=self._group(), async_op=True
            )
        if staged_out is out:
            return _completes_with(work, out)

        def finish(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            fut.wait()
            return out.copy_(staged_out)

        return work.get_future().then(finish)

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``all_gather_into_tensor`` (or a list gather where the engine lacks it)."""
        check_equal_split("all_gather", out, t, self.world_size)
        self.stats.record("all_gather", t.numel() * t.element_size(), self.world_size)
        staged_out = self._staged(out, copy=False)
        all_gather_flat(staged_out.view(-1), self._staged(t).reshape(-1), self._group())
        return out if staged_out is out else out.copy_(staged_out)

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``all_to_all_single``."""
        check_equal_split("all_to_all", out, t, self.world_size)
        self.stats.record("all_to_all", t.numel() * t.element_size(), self.world_size)
        staged_out = self._staged(out, copy=False)
        dist.all_to_all_single(
            staged_out.view(-1), self._staged(t).reshape(-1), group=self._group()
        )
        return out if staged_out is out else out.copy_(staged_out)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``torch.distributed.broadcast`` from ``src`` (a group rank)."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src {src} out of range for world size {self.world_size}")
        self.stats.record("broadcast", t.numel() * t.element_size(), self.world_size)
        # torch.distributed takes a global rank for src; translate from the group rank.
        group = self._group()
        global_src = src if group is None else dist.get_global_rank(group, src)
        staged = self._staged(t)
        dist.broadcast(staged, src=global_src, group=group)
        return t if staged is t else t.copy_(staged)

    def barrier(self) -> None:
        """``torch.distributed.barrier`` on this backend's group."""
        self.stats.record("barrier", 0, self.world_size)
        dist.barrier(group=self._group())

    def __repr__(self) -> str:
        return (
            f"TorchBackend(engine={self.engine!r}, rank={self.rank}, world_size={self.world_size})"
        )
