r"""Starting ranks, building each optimizer variant the same way, and counting what it sends.

Variants (labels as they appear in every table):

- ``Adam``: ``torch.optim.Adam``; the gradients are averaged by one fp32 ``all_reduce`` of one
  flat buffer per step through a commopt ``TorchBackend`` (so its byte counter applies).
- ``Local``: ``torch.optim.Adam`` on each rank's own gradients; nothing is communicated (the
  floor of any method that communicates; its replicas differ).
- ``DDP-fp32``: ``DistributedDataParallel`` without a hook (torch's C++ reducer, bucketed fp32
  all_reduce overlapped with backward) + ``torch.optim.Adam``. Its bytes are not observable
  from Python; the TCP benchmark uses it for timing only.
- ``DDP-fp16``: DDP with ``default_hooks.fp16_compress_hook`` + ``torch.optim.Adam``.
- ``DDP-PowerSGD``: DDP with ``powerSGD_hook`` (rank ``powersgd_rank``, error feedback, warm
  start, plain all_reduce for the first ``warmup`` iterations) + ``torch.optim.Adam``, in ONE
  bucket (see :func:`make_setup`).
- ``OnebitAdam``, ``ZeroOneAdam``, ``OnebitLamb``: the commopt optimizers with ``warmup`` as
  ``freeze_step`` / ``var_freeze_step``.
- ``ZeroOneAdam-1bitA``: 0/1 Adam kept in phase A (``var_freeze_step`` after the run) with
  ``var_update_scaler=1``, so its variance steps (fp32 averages) are steps 1, 2, 4, 8, 16, ...
  and every other step is a 1-bit gradient step.
- ``ZeroOneAdam-syncB``: 0/1 Adam with ``local_step_scaler`` large enough (2**30) that the local
  interval stays 1: every phase-B step is a sync step.
- ``X-overlap`` (X one of ``OnebitAdam``, ``OnebitLamb``, ``ZeroOneAdam``, ``ZeroOneAdam-1bitA``,
  ``ZeroOneAdam-syncB``): X with ``overlap=True``; X and X-overlap both get ``bucket_numel``, so
  their results are bit-identical.
- ``LAMB``: ``commopt.OnebitLamb`` with ``freeze_step`` larger than the run, i.e. only its
  full-precision warmup stage, which is LAMB (Adam moments, per-tensor trust ratio
  ‖p‖/‖u‖ clipped to [min_coeff, max_coeff], fp32 gradient average every step).
- ``DiLoCo-C-HK[-PF][-dD][-wW][-fS][-oR][-nesterov|-plain][-tensor]``: ``commopt.DiLoCo``
  around ``torch.optim.Adam`` (the ``Adam`` row's settings, its gradients local), compression
  C (``none``, ``bf16``, ``onebit``), ``sync_every`` K, F fragments, delay D, W warmup steps,
  the first S syncs in fp32 (``fp32_syncs``);
  outer step the compression's default, or the paper's Nesterov (lr 0.7, momentum 0.9), or
  plain averaging (lr 1, no momentum); R overrides the outer lr; ``-tensor``: one 1-bit scale
  per tensor (``scale="tensor"``, commopt's default), without it one per fragment.
  :func:`is_variant` accepts these labels (they are not in :data:`ALL_VARIANTS`).
- ``DiLoCo-torchft-HK[-oR][-nesterov|-plain]``: PyTorch's own DiLoCo (torchft, not installed
  with commopt), the same inner and outer optimizers (:mod:`experiments.harness.torchft_peer`).

Traffic model, the same for every variant: a ring all_reduce of B bytes costs one rank
2(n−1)/n·B bytes sent (SPEC §7; ``commopt.comm.base.model_bytes``). commopt variants report it
through ``backend.stats``. For DDP hooks an :class:`AllReduceCounter` replaces
``torch.distributed.all_reduce`` while a step runs and applies the same formula to the size of
every tensor the hook all-reduces (fp16 buckets; PowerSGD's uncompressed tensors, P and Q).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import commopt
from commopt.comm import TorchBackend
from commopt.comm.base import model_bytes
from commopt.optim.base import CompressedOptimizer
from experiments.harness.torchft_peer import TorchftDiLoCo, is_torchft_label

__all__ = [
    "ALL_VARIANTS",
    "AllReduceCounter",
    "Hyper",
    "Setup",
    "describe_machine",
    "is_variant",
    "make_setup",
    "rank_and_size",
    "replicas_identical",
    "sum_over_ranks",
    "train_on_task",
]

ALL_VARIANTS = (
    "Adam",
    "DDP-fp32",
    "DDP-fp16",
    "DDP-PowerSGD",
    "OnebitAdam",
    "ZeroOneAdam",
    "LAMB",
    "OnebitLamb",
    "OnebitAdam-overlap",  # OnebitAdam(overlap=True): bucket work starts from gradient hooks
    "DDP-OnebitAdam",  # DDP with commopt.ddp.onebit_hook, paired with OnebitAdam
    # the same, the 1-bit exchange left to step(), DDP's gradients as views of its buckets
    "DDP-OnebitAdam-late",
    "OnebitLamb-overlap",
    "ZeroOneAdam-overlap",
    "ZeroOneAdam-1bitA",  # phase A only, 1-bit gradient steps between sparse variance steps
    "ZeroOneAdam-1bitA-overlap",
    "ZeroOneAdam-syncB",  # phase B with a sync at every step
    "ZeroOneAdam-syncB-overlap",
    "Local",  # Adam on each rank's own gradients, no communication: the floor
)

_DILOCO = re.compile(
    r"DiLoCo-(?P<c>none|bf16|onebit)-H(?P<h>\d+)(?:-P(?P<p>\d+))?(?:-d(?P<d>\d+))?"
    r"(?:-w(?P<w>\d+))?(?:-f(?P<f>\d+))?(?:-o(?P<olr>[\d.]+))?(?:-(?P<outer>nesterov|plain))?(?P<t>-tensor)?"
)


def is_variant(label: str) -> bool:
    """Whether :func:`make_setup` builds ``label``: one of :data:`ALL_VARIANTS` or a DiLoCo
    label (module docstring)."""
    return label in ALL_VARIANTS or _DILOCO.fullmatch(label) is not None or is_torchft_label(label)


def _diloco(label: str, model: nn.Module, hp: Hyper, backend: TorchBackend) -> Any:
    m = _DILOCO.fullmatch(label)
    assert m is not None
    outer = {"nesterov": (0.7, 0.9), "plain": (1.0, 0.0)}.get(m["outer"] or "", (None, None))
    if m["olr"]:
        outer = (float(m["olr"]), outer[1])
    inner = torch.optim.Adam(
        model.parameters(), lr=hp.lr, betas=hp.betas, weight_decay=hp.weight_decay
    )
    opt = commopt.DiLoCo(
        inner,
        sync_every=int(m["h"]),
        compression=m["c"],
        fragments=int(m["p"] or 1),
        delay=int(m["d"] or 0),
        warmup_steps=int(m["w"] or 0),
        fp32_syncs=int(m["f"] or 0),
        scale="tensor" if m["t"] else "fragment",
        outer_lr=outer[0],
        outer_momentum=outer[1],
        backend=backend,
    )
    backend.stats.reset()  # the settings' agreement and rank 0's weights are not training traffic
    return opt


# The real all_reduce, captured before any counter is installed: metrics use it directly.
_ALL_REDUCE = dist.all_reduce
_BROADCAST = dist.broadcast


# -- ranks ---------------------------------------------------------------------------------------
def rank_and_size() -> tuple[int, int]:
    """(rank, world size) of torch.distributed's default group, or (0, 1) without one."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def sum_over_ranks(values: list[float]) -> list[float]:
    """Element-wise sum over ranks (float64), outside every byte counter."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        _ALL_REDUCE(t)
    return t.tolist()


def describe_machine() -> str:
    """CPU model, core count, load average, torch version: one line for a report."""
    cpu = platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{cpu}, {os.cpu_count()} cores, load average {load}, torch {torch.__version__}, "
        f"python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )


# -- traffic of DDP hooks ------------------------------------------------------------------------
class AllReduceCounter:
    """Counts ``torch.distributed.all_reduce`` calls and their ring-model bytes while active.

    ``install()`` replaces the module attribute (DDP's Python comm hooks call
    ``dist.all_reduce``); :meth:`counting` enables counting for a region, e.g. one
    backward+step, so that metric collectives elsewhere are not counted.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.calls = 0
        self.bytes_sent = 0
        self._active = False

    def _all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self._active:
            self.calls += 1
            nbytes = tensor.numel() * tensor.element_size()
            self.bytes_sent += model_bytes("all_reduce", nbytes, self.world_size)
        return _ALL_REDUCE(tensor, *args, **kwargs)

    def install(self) -> None:
        dist.all_reduce = self._all_reduce

    @staticmethod
    def uninstall() -> None:
        dist.all_reduce = _ALL_REDUCE

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        self._active = True
        try:
            yield
        finally:
            self._active = False


# -- variants ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Hyper:
    """Hyper-parameters shared by the variants of one experiment."""

    lr: float
    """learning rate of the Adam family (Adam, DDP-*, OnebitAdam, ZeroOneAdam)"""
    lamb_lr: float
    """learning rate of LAMB and OnebitLamb"""
    warmup: int
    """freeze_step (OnebitAdam, OnebitLamb), var_freeze_step (ZeroOneAdam), start_powerSGD_iter"""
    steps: int
    """length of the run (LAMB's freeze_step is steps + 1)"""
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    powersgd_rank: int = 4
    var_update_scaler: int = 16
    local_step_scaler: int = 32768
    local_step_clipper: int = 16
    bucket_numel: int | None = None
    """bucket_numel of the commopt variants (None: each optimizer's default)"""
    rules: str = "default"
    """"papers": the papers' rules where a default goes beyond them (ZeroOneAdam
    ``bias_correction=False``, OnebitLamb ``trust_ratio="frozen"``)"""


class Setup:
    """One variant ready to train ``module``: call :meth:`step` after computing the loss.

    ``model`` is what to call for the forward pass (the DDP wrapper where there is one).
    ``bytes_sent``/``collectives``: this rank's modelled bytes and number of collective calls
    so far (training steps only). ``comm_steps``: steps that exchanged gradient or model data.
    """

    def __init__(
        self,
        label: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        backend: TorchBackend | None,
        counter: AllReduceCounter | None,
        average_gradients: bool,
    ) -> None:
        self.label = label
        self.model = model
        self.optimizer = optimizer
        self._backend = backend
        self._counter = counter
        self._average_gradients = average_gradients
        self._params = [p for p in model.parameters() if p.requires_grad]
        self.comm_steps = 0
        self.steps = 0
        #: seconds spent in backward (with any average the variant does there) and in step()
        self.seconds = {"backward": 0.0, "step": 0.0}

    @property
    def bytes_sent(self) -> int:
        if self._counter is not None:
            return self._counter.bytes_sent
        return self._backend.stats.bytes_sent if self._backend is not None else 0

    @property
    def collectives(self) -> int:
        if self._counter is not None:
            return self._counter.calls
        return self._backend.stats.calls if self._backend is not None else 0

    def _data_rounds(self) -> int:
        if isinstance(self.optimizer, CompressedOptimizer):
            s = self.optimizer.comm_stats()
            return s["full_precision_rounds"] + s["compressed_rounds"]
        return self.collectives

    def step(self, loss: torch.Tensor) -> None:
        """zero_grad, backward, (average), optimizer step; traffic counted."""
        self.optimizer.zero_grad(set_to_none=False)
        before = self._data_rounds()
        with self._counter.counting() if self._counter else contextlib.nullcontext():
            t0 = time.perf_counter()
            loss.backward()
            if self._average_gradients and self._backend is not None:
                flat = torch.cat([p.grad.reshape(-1) for p in self._params])
                self._backend.all_reduce(flat, "avg")
                offset = 0
                for p in self._params:
                    p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
            t1 = time.perf_counter()
            self.optimizer.step()
            self.seconds["backward"] += t1 - t0
            self.seconds["step"] += time.perf_counter() - t1
        self.steps += 1
        self.comm_steps += int(self._data_rounds() > before)

    def close(self) -> None:
        if self._counter is not None:
            self._counter.uninstall()

    def stage(self, step: int, hp: Hyper) -> str:
        """Which stage step ``step`` (1-based) belongs to, for logs and CSVs."""
        base = self.label.removesuffix("-overlap")
        if base in ("OnebitAdam", "OnebitLamb", "DDP-OnebitAdam", "DDP-OnebitAdam-late"):
            return "warmup" if step <= hp.warmup else "compressed"
        if base == "ZeroOneAdam-1bitA":
            return "phaseA"
        if base in ("ZeroOneAdam", "ZeroOneAdam-syncB"):
            return "phaseA" if step <= hp.warmup else "phaseB"
        if self.label == "DDP-PowerSGD":
            return "allreduce" if step < hp.warmup else "powersgd"
        if self.label == "Local" or self.label.startswith("DiLoCo"):
            return "local" if self.label == "Local" else "local+sync"
        return "full"


def make_setup(label: str, model: nn.Module, hp: Hyper) -> Setup:
    """Build variant ``label`` (one of :data:`ALL_VARIANTS`) around ``model`` on every rank.

    Every rank must call it with the same arguments; rank 0's weights are broadcast first.
    """
    if not is_variant(label):
        raise ValueError(f"unknown variant {label!r}; choose from {list(ALL_VARIANTS)} or DiLoCo")
    backend = TorchBackend()  # a fresh byte counter per variant
    commopt.broadcast_parameters(model, backend=backend)
    backend.stats.reset()
    n = backend.world_size
    if is_torchft_label(label):  # PyTorch's own DiLoCo, the peer (needs torchft installed)
        peer = TorchftDiLoCo(label, model, hp.lr, hp.betas, hp.weight_decay)
        return Setup(label, model, peer, peer, None, average_gradients=False)  # type: ignore[arg-type]
    if label.startswith("DiLoCo"):
        opt = _diloco(label, model, hp, backend)
        return Setup(label, model, opt, backend, None, average_gradients=False)
    if label in ("DDP-OnebitAdam", "DDP-OnebitAdam-late"):
        late = label.endswith("-late")
        ddp = DistributedDataParallel(model, gradient_as_bucket_view=late)
        opt = commopt.OnebitAdam(
            ddp.parameters(),
            lr=hp.lr,
            betas=hp.betas,
            weight_decay=hp.weight_decay,
            freeze_step=hp.warmup,
            backend=backend,
        )
        hook_state = commopt.ddp.OnebitHookState(opt, exchange_in_backward=not late)
        ddp.register_comm_hook(hook_state, commopt.ddp.onebit_hook)
        return Setup(label, ddp, opt, backend, None, average_gradients=False)
    if label.startswith("DDP"):
        if label == "DDP-PowerSGD":
            # One bucket: with several, PowerSGD's chained all_reduce callbacks can complete in
            # a different order on different ranks and gloo then pairs mismatched collectives
            # ("Received data size doesn't match expected size"), seen on netlab at 25M params.
            mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
            ddp = DistributedDataParallel(model, bucket_cap_mb=max(25, int(mib) + 1))
        else:
            ddp = DistributedDataParallel(model)
        counter = None
        if label == "DDP-fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif label == "DDP-PowerSGD":
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=hp.powersgd_rank,
                start_powerSGD_iter=max(2, hp.warmup),
                use_error_feedback=True,
                warm_start=True,
                random_seed=0,
            )
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        if label != "DDP-fp32":
            counter = AllReduceCounter(n)
            counter.install()
        opt = torch.optim.Adam(
            ddp.parameters(), lr=hp.lr, betas=hp.betas, weight_decay=hp.weight_decay
        )
        return Setup(label, ddp, opt, None, counter, average_gradients=False)
    params: Any = list(model.parameters())
    opt: torch.optim.Optimizer
    if label in ("Adam", "Local"):
        opt = torch.optim.Adam(params, lr=hp.lr, betas=hp.betas, weight_decay=hp.weight_decay)
        return Setup(label, model, opt, backend, None, average_gradients=label == "Adam")
    base = label.removesuffix("-overlap")
    commopt_kw: dict[str, Any] = {
        "betas": hp.betas,
        "weight_decay": hp.weight_decay,
        "backend": backend,
        "overlap": label.endswith("-overlap"),
        "bucket_numel": hp.bucket_numel,
    }
    if base == "OnebitAdam":
        opt = commopt.OnebitAdam(params, lr=hp.lr, freeze_step=hp.warmup, **commopt_kw)
    elif base.startswith("ZeroOneAdam"):
        opt = commopt.ZeroOneAdam(
            params,
            lr=hp.lr,
            # 1bitA: never leaves phase A; variance steps at 1, 2, 4, 8, ...
            var_freeze_step=hp.steps + 1 if base == "ZeroOneAdam-1bitA" else hp.warmup,
            var_update_scaler=1 if base == "ZeroOneAdam-1bitA" else hp.var_update_scaler,
            # syncB: the local interval never doubles, so every phase-B step syncs
            local_step_scaler=2**30 if base == "ZeroOneAdam-syncB" else hp.local_step_scaler,
            local_step_clipper=hp.local_step_clipper,
            **({"bias_correction": False} if hp.rules == "papers" else {}),
            **commopt_kw,
        )
    elif label == "LAMB":
        opt = commopt.OnebitLamb(
            params,
            lr=hp.lamb_lr,
            betas=hp.betas,
            weight_decay=hp.weight_decay,
            freeze_step=hp.steps + 1,
            backend=backend,
        )
    else:  # OnebitLamb, OnebitLamb-overlap
        if hp.rules == "papers":
            commopt_kw["trust_ratio"] = "frozen"
        opt = commopt.OnebitLamb(params, lr=hp.lamb_lr, freeze_step=hp.warmup, **commopt_kw)
    return Setup(label, model, opt, backend, None, average_gradients=False)


# -- the training loop every task experiment runs -------------------------------------------------
#: ``record(step, evaluation, train_seconds)``: called after every step (and before the first
#: with step 0 when asked); ``evaluation`` is the task's (val_loss, metric) on evaluation steps,
#: else None; ``train_seconds`` the time in forward, backward and step so far.
Record = Callable[[int, "tuple[float, float] | None", float], None]


def train_on_task(
    task: Any,
    setup: Setup,
    steps: int,
    eval_every: int,
    record: Record,
    evaluate_first: bool = False,
    schedule: Callable[[int], None] | None = None,
) -> list[float]:
    """Train ``setup`` on the task's batches 1 … ``steps`` (every rank the same order; the task
    shards them), evaluating every ``eval_every`` steps and at the last; returns this rank's
    training loss per step. ``schedule(step)`` runs before each step's batch (an lr
    schedule)."""
    train_time, losses = 0.0, []
    if evaluate_first:
        record(0, task.evaluate(setup.model), train_time)
    for step in range(1, steps + 1):
        if schedule is not None:
            schedule(step)
        batch = task.batch(step)
        t0 = time.perf_counter()
        loss = task.loss(setup.model, batch)
        setup.step(loss)
        train_time += time.perf_counter() - t0
        losses.append(float(loss.detach()))
        if step == steps and hasattr(setup.optimizer, "finish"):
            setup.optimizer.finish()  # DiLoCo: the delayed and the stale fragments synced
        evaluate = step % eval_every == 0 or step == steps
        record(step, task.evaluate(setup.model) if evaluate else None, train_time)
    return losses


def replicas_identical(model: nn.Module) -> bool:
    """Every rank holds rank 0's parameters bit for bit (agreed on every rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = flat.clone()
    _BROADCAST(ref, src=0)
    return sum_over_ranks([float(not torch.equal(ref, flat))])[0] == 0
