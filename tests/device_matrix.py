"""The optimizer × mode matrix on several ranks, on any device: what GPU users rely on.

Every optimizer of the registry (tests/optim_registry.py, its test schedule, which visits every
phase) trains the same small GELU MLP in four modes, on per-rank batches:

- ``standalone``: the optimizer averages the gradients itself;
- ``overlap``: ``overlap=True``, each bucket's communication started during backward;
- ``ddp-small`` / ``ddp-large``: a DistributedDataParallel model with ``commopt.ddp.onebit_hook``,
  DDP buckets of :data:`DDP_SMALL_MB` (one or two parameters each) and of 25 MB (one bucket);
- ``fsdp``: FSDP2 over a (4, 1) mesh, the optimizer attached with ``commopt.fsdp.attach``:
  4 replicas of one shard, which is the standalone optimizer bit for bit;
- ``hsdp``: FSDP2 over the shard dimension of a (2, 2) mesh, 1 bit between the 2 replicas: a
  computation of its own (full precision inside each shard group), so only 0. and 1. below.

All modes use the same optimizer buckets (``bucket_numel`` = :data:`OPT_BUCKET`, several per
model), so their results must be bitwise equal. :func:`run_matrix` runs on one rank and returns
per-step digests of the parameters; :func:`check_matrix` asserts, over every rank's results:

0. the parameters stay finite;
1. the replicas are bit-identical after every step that communicates (0/1 Adam's local steps
   excepted, as the registry's phases say);
2. every mode of :data:`SAME_AS_STANDALONE` is bitwise equal to ``standalone`` after every step.

Used by tests/multirank/test_device_logic_gloo.py (4 forked gloo ranks on CPU, the CUDA kernels
executed on CPU threads, scratch poisoned) and tests/gpu/test_multirank_gpu.py (4 spawned ranks
sharing one GPU over gloo with CUDA tensors, and over MPI with host staging).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

import commopt
import commopt.fsdp
from tests.optim_registry import OPTIMIZERS

__all__ = [
    "DDP_SMALL_MB",
    "MODES",
    "OPT_BUCKET",
    "SAME_AS_STANDALONE",
    "WHOLE_MODES",
    "check_matrix",
    "run_matrix",
]

#: the modes on whole parameters, and all of them (the sharded ones added)
WHOLE_MODES = ("standalone", "overlap", "ddp-small", "ddp-large")
MODES = (*WHOLE_MODES, "fsdp", "hsdp")
#: the modes bitwise equal to ``standalone`` (2. below)
SAME_AS_STANDALONE = ("overlap", "ddp-small", "ddp-large", "fsdp")
DDP_SMALL_MB = 0.004  # ~1000 fp32 elements: DDP buckets of one or two parameters
OPT_BUCKET = 1500  # optimizer buckets: several per model, the same layout in every mode
SIZES = (24, 48, 40, 6)  # 24-48-40-6 GELU MLP: 3406 parameters in six tensors


def _model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(SIZES)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(torch.nn.GELU())
    return torch.nn.Sequential(*layers).to(device)


def _batch(rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + 31 * rank)
    x, y = torch.randn(16, SIZES[0], generator=g), torch.randn(16, SIZES[-1], generator=g)
    return x.to(device), y.to(device)


def _whole(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter, whole (a sharded one gathered), flat on the CPU."""
    from torch.distributed.tensor import DTensor

    return torch.cat(
        [
            (p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1).cpu()
            for p in model.parameters()
        ]
    )


def _digest(model: torch.nn.Module) -> str:
    return hashlib.sha1(_whole(model).numpy().tobytes()).hexdigest()[:16]


def _fully_shard(model: torch.nn.Module, device: torch.device, world: int, shards: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(
        device.type, (world // shards, shards), mesh_dim_names=("replicate", "shard")
    )
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    return mesh


def _train(backend: Any, name: str, mode: str, device: torch.device) -> dict[str, Any]:
    info = next(i for i in OPTIMIZERS if i.name == name)
    model = _model(device)
    net: torch.nn.Module = model
    kwargs: dict[str, Any] = {"backend": backend, "bucket_numel": OPT_BUCKET}
    if mode == "overlap":
        kwargs["overlap"] = True
    if mode.startswith("ddp"):
        cap = DDP_SMALL_MB if mode == "ddp-small" else 25.0
        net = DistributedDataParallel(model, bucket_cap_mb=cap)
    mesh = None
    if mode in ("fsdp", "hsdp"):
        mesh = _fully_shard(model, device, backend.world_size, 1 if mode == "fsdp" else 2)
    opt = info.make(net.parameters(), **kwargs)
    if mesh is not None:
        commopt.fsdp.attach(model, opt, mesh)
    if mode.startswith("ddp"):
        net.register_comm_hook(
            commopt.ddp.OnebitHookState(opt, exchange_in_backward=True), commopt.ddp.onebit_hook
        )
    digests, losses = [], []
    for step in range(1, info.steps + 1):
        x, y = _batch(backend.rank, step, device)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        digests.append(_digest(model))
        losses.append(float(loss.detach()))
    params = _whole(model)
    del opt, net
    return {"digests": digests, "losses": losses, "params": params}


def run_matrix(
    backend: Any,
    device: str | torch.device = "cpu",
    names: Sequence[str] | None = None,
    modes: Sequence[str] = MODES,
) -> dict[tuple[str, str], dict[str, Any]]:
    """Train every (optimizer, mode) on this rank; ``{(name, mode): {"digests": per-step
    parameter digests, "losses": per-step losses, "params": final flat parameters (CPU)}}``."""
    device = torch.device(device)
    names = [i.name for i in OPTIMIZERS] if names is None else list(names)
    return {(n, m): _train(backend, n, m, device) for n in names for m in modes}


def check_matrix(results: Sequence[dict[tuple[str, str], dict[str, Any]]]) -> None:
    """Assert 0.–2. of the module docstring over every rank's :func:`run_matrix` result."""
    problems = []
    for rank, result in enumerate(results):
        for (name, mode), got in result.items():
            if not bool(torch.isfinite(got["params"]).all()):
                problems.append(f"{name} {mode}: rank {rank} ends with non-finite parameters")
    for (name, mode), first in results[0].items():
        info = next(i for i in OPTIMIZERS if i.name == name)
        for step in range(1, len(first["digests"]) + 1):
            if not info.phase_of(step).communicates:
                continue
            got = [r[(name, mode)]["digests"][step - 1] for r in results]
            if len(set(got)) != 1:
                problems.append(f"{name} {mode}: replicas differ after step {step}: {got}")
                break
        if mode in SAME_AS_STANDALONE:
            base = [r[(name, "standalone")]["digests"] for r in results]
            mine = [r[(name, mode)]["digests"] for r in results]
            for rank, (b, m) in enumerate(zip(base, mine, strict=True)):
                if b != m:
                    step = next(k for k, (u, v) in enumerate(zip(b, m, strict=True), 1) if u != v)
                    problems.append(
                        f"{name} {mode}: rank {rank} differs from standalone from step {step}"
                    )
                    break
    assert not problems, "\n".join(problems)
