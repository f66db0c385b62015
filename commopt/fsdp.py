r"""commopt's optimizers on FSDP2: sharded inside a group of ranks, one bit between the groups.

Usage, on R × S ranks (R replicas of S shards; docs/fsdp.md)::

    mesh = init_device_mesh("cuda", (R, S), mesh_dim_names=("replicate", "shard"))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    optimizer = commopt.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=1000)
    commopt.fsdp.attach(model, optimizer, mesh)
    # the training loop is unchanged: backward, optimizer.step(), zero_grad

FSDP2 shards parameters, gradients and (through the optimizer, which only ever sees its
rank's shards) the optimizer state over the *shard* dimension: parameters are all-gathered
for forward and backward, and the gradient is reduce-scattered at full precision, inside the
shard group (the fast link). The *replicate* dimension is commopt's: each step the optimizer
averages its shard of the gradient across the R replicas at full precision (warmup), or runs
the error-compensated 1-bit exchange on its shard of the momentum with them (compression), so
only one bit per element crosses the slow network.

Why FSDP2 is given the shard dimension alone, not the whole 2-D mesh (its native HSDP): on a
2-D mesh FSDP2 all-reduces every gradient across replicas at full precision, and in torch 2.13
the only switch, ``set_requires_all_reduce(False)``, *defers* that all-reduce to a later
backward and leaves ``p.grad`` unset meanwhile; it cannot be turned off for a step. The bytes
commopt sends across replicas in warmup are those of FSDP2's own all-reduce (one fp32
all-reduce of the shard), and the result is the same average.

Checkpoints: :func:`save_checkpoint` / :func:`load_checkpoint` write and read the model and
optimizer through ``torch.distributed.checkpoint`` (DCP), the state sharded like the
parameters (:func:`optimizer_state_dict`). DCP writes one copy of what it takes for a replicated
shard, so where the replicas differ (0/1 Adam between syncs; :class:`~commopt.DiLoCo` between
syncs, which needs no :func:`attach`: docs/fsdp.md) each replica's own is written apart.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from commopt.comm import Backend, MpiBackend, TorchBackend
from commopt.diloco import DiLoCo
from commopt.diloco.averages import local_shard
from commopt.faults import watch_like
from commopt.optim.base import CompressedOptimizer
from commopt.sharding import Sharding

__all__ = [
    "attach",
    "load_checkpoint",
    "optimizer_state_dict",
    "save_checkpoint",
    "set_optimizer_state_dict",
]

_PER_RANK = ("world_size", "rank", "exchange", "buckets")  # of the "commopt" entry


def attach(
    model: nn.Module, optimizer: CompressedOptimizer, mesh: DeviceMesh | None = None
) -> Sharding:
    """Make ``optimizer`` step ``model``'s FSDP2 shards, replicated over the rest of ``mesh``.

    Call it once, after ``fully_shard`` and after building the optimizer, before the first step
    (and before loading a checkpoint).

    Args:
        model: sharded with ``fully_shard(..., mesh=mesh[shard_dim])``, a 1-D sub-mesh.
        optimizer: a commopt optimizer over ``model``'s parameters.
        mesh: the 2-D (replicate, shard) mesh the shard mesh was taken from; None: the replicate
            groups are found from the shard groups (collective) and created.

    Returns:
        The :class:`~commopt.sharding.Sharding` the optimizer now uses.

    Raises:
        TypeError: ``model`` is not FSDP2-wrapped, or ``optimizer`` is not a commopt optimizer.
        ValueError: a layout with nothing to replicate (pure FSDP) or FSDP2's native HSDP, a
            mesh that does not fit, or what :meth:`~CompressedOptimizer.shard_over` refuses.
    """
    if not isinstance(optimizer, CompressedOptimizer):
        raise TypeError(
            f"commopt.fsdp.attach needs a commopt optimizer, got {type(optimizer).__name__}"
        )
    from torch.distributed.fsdp import FSDPModule

    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        raise TypeError(
            f"commopt.fsdp.attach: {type(model).__name__} is not FSDP2-wrapped; call "
            "torch.distributed.fsdp.fully_shard(module, mesh=mesh['shard']) on it first "
            "(docs/fsdp.md); for a DDP model use commopt.ddp"
        )
    params = [p for g in optimizer.param_groups for p in g["params"]]
    whole = [i for i, p in enumerate(params) if not isinstance(p, DTensor)]
    if whole:
        raise ValueError(
            f"commopt.fsdp.attach: {len(whole)} of the optimizer's parameters are not sharded "
            f"(the first is parameter {whole[0]}); build the optimizer from the FSDP2 model's "
            "parameters, after fully_shard"
        )
    meshes = {p.device_mesh for p in params}  # type: ignore[attr-defined]
    if len(meshes) != 1:
        raise ValueError(
            f"commopt.fsdp.attach: the parameters are sharded over {len(meshes)} meshes; "
            "shard every module over the same mesh['shard']"
        )
    shard_mesh = meshes.pop()
    if shard_mesh.ndim != 1:
        raise ValueError(
            "commopt.fsdp.attach: the parameters are sharded over a "
            f"{shard_mesh.ndim}-D mesh {shard_mesh.mesh_dim_names} (FSDP2's native HSDP), "
            "which all-reduces every gradient across replicas at full precision and cannot "
            "skip it (torch's set_requires_all_reduce(False) only defers it); shard over the "
            "shard dimension alone, fully_shard(module, mesh=mesh['shard']), and pass the 2-D "
            "mesh to attach: commopt then does the cross-replica average, at one bit"
        )
    backend = optimizer.backend
    if mesh is not None:
        replicate = mesh.get_group(_replicate_dim(mesh, shard_mesh))
        size = mesh.size()
    else:
        replicate, size = _replicate_group(shard_mesh), dist.get_world_size()
    if backend.world_size != size:
        raise ValueError(
            f"commopt.fsdp.attach: the optimizer's backend has {backend.world_size} ranks, the "
            f"mesh {size}; give the optimizer the default (whole-job) backend"
        )
    sharding = _sharding(backend, replicate, shard_mesh.get_group())
    optimizer.shard_over(sharding)
    return sharding


def _sharding(backend: Backend, replicate: dist.ProcessGroup, shard: dist.ProcessGroup) -> Sharding:
    """The two groups on the optimizer's kind of backend, watched as it is: torch's process
    groups, or (an MpiBackend) its communicator split alike: by shard index for the
    replicas, by replica index for the shards, ranked by the other index."""
    i, j = dist.get_rank(replicate), dist.get_rank(shard)  # (replica i, shard j)
    if isinstance(backend, MpiBackend):
        cuda_aware = backend.cuda_aware
        pair: tuple[Backend, Backend] = (
            MpiBackend(backend.comm.Split(j, i), cuda_aware=cuda_aware),
            MpiBackend(backend.comm.Split(i, j), cuda_aware=cuda_aware),
        )
    elif isinstance(backend, TorchBackend):
        pair = TorchBackend(replicate), TorchBackend(shard)
    else:
        raise TypeError(
            f"commopt.fsdp.attach: the optimizer's backend is a {type(backend).__name__}; "
            "sharding needs a TorchBackend or an MpiBackend over the whole job"
        )
    return Sharding(replicate=watch_like(backend, pair[0]), shard=watch_like(backend, pair[1]))


def _replicate_group(shard_mesh: DeviceMesh) -> dist.ProcessGroup:
    """This rank's replicate group when no 2-D mesh is given: the ranks at its position in
    every shard group (collective: every rank gathers every shard group, then creates every
    replicate group in the same order)."""
    mine = dist.get_process_group_ranks(shard_mesh.get_group())
    every: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    shard_groups = sorted({tuple(g) for g in every if g is not None})
    if len(shard_groups) < 2:
        _replicate_dim(shard_mesh, shard_mesh)  # raises: pure FSDP
    if len({len(g) for g in shard_groups}) != 1:
        raise ValueError("commopt.fsdp.attach: shard groups of unequal sizes")
    groups = [dist.new_group([g[j] for g in shard_groups]) for j in range(len(shard_groups[0]))]
    return groups[mine.index(dist.get_rank())]


def _replicate_dim(root: DeviceMesh, shard_mesh: DeviceMesh) -> str | int:
    """The dimension of ``root`` that is not ``shard_mesh`` (ValueError: there is none)."""
    if root.ndim == 1:
        raise ValueError(
            "commopt.fsdp.attach: the parameters are sharded over every rank (pure FSDP, a "
            "1-D mesh): no two ranks hold the same shard, so there is nothing to average at "
            "one bit; FSDP2's reduce-scatter is already all the gradient traffic. Use a 2-D "
            "mesh (replicate, shard) with replicate > 1 across the slow link, or a "
            "torch.optim optimizer"
        )
    names = root.mesh_dim_names
    shard_names = shard_mesh.mesh_dim_names
    if root.ndim != 2 or names is None or shard_names is None or shard_names[0] not in names:
        raise ValueError(
            f"commopt.fsdp.attach: expected a 2-D (replicate, shard) mesh with named "
            f"dimensions that contains the parameters' mesh {shard_names}, got "
            f"{root.ndim}-D {names}"
        )
    other = names[1 - names.index(shard_names[0])]
    if root.size(names.index(other)) < 2:
        raise ValueError(
            f"commopt.fsdp.attach: the {other!r} dimension has one rank: nothing to replicate "
            "across (see pure FSDP in docs/fsdp.md)"
        )
    return other


# -- checkpoints (torch.distributed.checkpoint) ------------------------------------------------
def optimizer_state_dict(optimizer: CompressedOptimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` ready for ``torch.distributed.checkpoint``.

    Each parameter's state (m, v, …) is a DTensor laid out like its parameter, so DCP saves every
    shard once and can load it at another shard size. What belongs to one rank alone (its
    exchange buffers) moves under ``"ranks"/<layout name>``, which only this rank writes and
    reads. The tensors share storage with the optimizer's state: ``dcp.load`` into this dict
    writes the state in place; then call :func:`set_optimizer_state_dict`.
    """
    optimizer.flat_states  # noqa: B018  (lays out the state, so there is something to load into)
    sd = optimizer.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for index, entry in sd["state"].items():
        p = params[index]
        state[index] = {k: _as_dtensor(v, p) for k, v in entry.items()}
    comm = dict(sd["commopt"])
    mine = {k: comm.pop(k) for k in _PER_RANK}
    # One-element tuples are leaves to DCP: saved and loaded whole, keys the template (a fresh
    # optimizer's state dict) does not have yet included, such as a scheduler's "initial_lr".
    return {
        "state": state,
        "param_groups": (sd["param_groups"],),
        "commopt": (comm,),
        "ranks": {_rank_key(optimizer): mine},
    }


def set_optimizer_state_dict(
    optimizer: CompressedOptimizer, state_dict: dict[str, Any], *, exchange_loaded: bool = True
) -> None:
    """Load what :func:`optimizer_state_dict` gave and ``dcp.load`` filled.

    ``exchange_loaded=False``: this rank's exchange buffers were not in the checkpoint (saved in
    another layout); they start from zero, with one warning, and everything else is restored.
    """
    sd = {
        "state": {
            int(i): {k: v.to_local() if isinstance(v, DTensor) else v for k, v in e.items()}
            for i, e in state_dict["state"].items()
        },
        "param_groups": state_dict["param_groups"][0],
        "commopt": dict(state_dict["commopt"][0]),
    }
    mine = state_dict["ranks"].get(_rank_key(optimizer))
    if exchange_loaded and mine is not None:
        sd["commopt"].update(mine)
    else:
        warnings.warn(
            f"{type(optimizer).__name__}: the checkpoint has no exchange buffers for layout "
            f"{_rank_key(optimizer)} (saved at another mesh); they start from zero, the "
            "moments and schedule are restored (resharded by DCP)",
            stacklevel=2,
        )
        sd["commopt"].update(world_size=None, rank=None, exchange=None, buckets=[])
    optimizer.load_state_dict(sd)


def save_checkpoint(
    path: str | os.PathLike[str], model: nn.Module, optimizer: CompressedOptimizer | DiLoCo
) -> None:
    """Save ``model`` (FSDP2's sharded state dict) and ``optimizer`` with DCP (collective)."""
    import torch.distributed.checkpoint as dcp

    if isinstance(optimizer, DiLoCo):
        state = _diloco_state_dict(model, optimizer)
    else:
        state = {"model": model.state_dict(), "optimizer": optimizer_state_dict(optimizer)}
        own = {"model": state["model"], "state": state["optimizer"]["state"]}
        if not _replicas_agree(optimizer, own):
            # (0/1 Adam between syncs) DCP keeps one copy of what it takes for replicated
            # shards; each replica's own parameters and state are written apart as well
            state["replicas"] = {_replica_key(optimizer): own}
    dcp.save(state, checkpoint_id=os.fspath(path))


def load_checkpoint(
    path: str | os.PathLike[str], model: nn.Module, optimizer: CompressedOptimizer | DiLoCo
) -> None:
    """Load what :func:`save_checkpoint` wrote, at this mesh (collective).

    At the same mesh the resume is bit-exact. At another shard size DCP reshards the
    parameters and the optimizer's moments; the exchange buffers, which belong to one rank of
    one layout, start from zero (one warning), as for a world-size change without FSDP.
    A :class:`~commopt.DiLoCo` resumes at the same mesh only.

    Raises:
        ValueError: a DiLoCo checkpoint saved at another mesh (nothing is loaded).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    path = os.fspath(path)
    if isinstance(optimizer, DiLoCo):
        _load_diloco(path, model, optimizer)
        return
    state = {"model": model.state_dict(), "optimizer": optimizer_state_dict(optimizer)}
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    replica = _replica_key(optimizer)
    if any(k.startswith(f"replicas.{replica}.") for k in saved):  # replicas differed, this mesh
        # this replica's own copies, instead of the shared ones (which are one replica's)
        mine = {"model": state.pop("model"), "state": state["optimizer"].pop("state")}
        state["replicas"] = {replica: mine}
        _add_saved_keys(mine, optimizer, saved, ("replicas", replica, "state"))
    else:
        if any(k.startswith("replicas.") for k in saved):
            warnings.warn(
                f"{type(optimizer).__name__}: the replicas differed when {path} was saved "
                "(0/1 Adam between syncs) and it was saved at another mesh; every replica "
                "resumes from one replica's parameters and state",
                stacklevel=2,
            )
        _add_saved_keys(state["optimizer"], optimizer, saved)
    prefix = f"optimizer.ranks.{_rank_key(optimizer)}."
    here = any(k.startswith(prefix) for k in saved)
    if not here:
        state["optimizer"]["ranks"] = {}
    partial = not here or "replicas" in state
    dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=partial))
    if "replicas" in state:
        mine = state["replicas"][replica]
        state["model"], state["optimizer"]["state"] = mine["model"], mine["state"]
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(optimizer, state["optimizer"], exchange_loaded=here)


def _add_saved_keys(
    template: dict[str, Any],
    optimizer: CompressedOptimizer | DiLoCo,
    saved: Any,
    prefix: tuple[str, ...] = ("optimizer", "state"),
) -> None:
    """Give ``template`` a place for every per-parameter state the checkpoint has under
    ``prefix`` and it lacks (state allocated on first use, such as 0/1 Adam's ``p_sync`` or
    AdamW's moments): DCP loads only what the template names, and would drop the rest without
    a word."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    n = len(prefix)
    for fqn, meta in saved.items():
        parts = fqn.split(".")
        if tuple(parts[:n]) != prefix or len(parts) != n + 2 or not parts[n].isdigit():
            continue
        index, key = int(parts[n]), parts[n + 1]
        entry = template["state"].setdefault(index, {})
        if key in entry or index >= len(params):
            continue
        p = params[index]
        size = getattr(meta, "size", None)
        if size is not None and len(size) == 0:
            entry[key] = torch.zeros((), dtype=torch.float32)
        elif size is not None and tuple(size) == tuple(p.shape):
            local = p.to_local() if isinstance(p, DTensor) else p
            entry[key] = _as_dtensor(torch.zeros(local.shape, dtype=torch.float32), p)


def _diloco_key() -> str:
    return f"diloco_rank{dist.get_rank()}_of{dist.get_world_size()}"


def _diloco_replica(optimizer: DiLoCo) -> str:
    """This rank's replica: its rank in DiLoCo's backend, the replicate group."""
    return f"replica{optimizer.backend.rank}"


def _diloco_state_dict(model: nn.Module, optimizer: DiLoCo) -> dict[str, Any]:
    """The model and DiLoCo for DCP. Between syncs each replica's parameters and inner state are
    its own, so they go under ``"replica<i>"``: DCP would otherwise keep one replica's copy of
    what it takes for replicated shards. The anchors (and outer momentum), the same on every
    replica, are shared, as DTensors like their parameters; this rank's own part (error
    buffers, step, a sync in flight) is one leaf under ``"ranks"/<rank>``. Shares storage with
    the model's and DiLoCo's tensors."""
    sd = optimizer.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    shared: dict[int, dict[str, Any]] = {}
    own: dict[int, dict[str, Any]] = {}
    for i, entry in sd["state"].items():
        for k, v in entry.items():
            part = shared if k.startswith("diloco_") else own  # the anchor, the outer momentum
            part.setdefault(i, {})[k] = _as_dtensor(v, params[i])
    return {
        _diloco_replica(optimizer): {
            "model": model.state_dict(),
            "inner": {"state": own, "param_groups": (sd["param_groups"],)},
        },
        "outer": {"state": shared},
        "ranks": {_diloco_key(): (sd["commopt"],)},
    }


def _load_diloco(path: str, model: nn.Module, optimizer: DiLoCo) -> None:
    import torch.distributed.checkpoint as dcp

    state = _diloco_state_dict(model, optimizer)
    replica = _diloco_replica(optimizer)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    if f"ranks.{_diloco_key()}" not in saved:
        raise ValueError(
            f"commopt.fsdp.load_checkpoint: {path} holds no DiLoCo part for rank "
            f"{dist.get_rank()} of {dist.get_world_size()}; DiLoCo on FSDP2 resumes at the mesh "
            "it was saved at"
        )
    # the inner state is made on the first step: give it a place to load into
    _add_saved_keys(state[replica]["inner"], optimizer, saved, (replica, "inner", "state"))
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state[replica]["model"])
    inner = state[replica]["inner"]
    merged = {i: dict(e) for i, e in inner["state"].items()}
    for i, entry in state["outer"]["state"].items():
        merged.setdefault(i, {}).update(entry)
    optimizer.load_state_dict(
        {
            "state": merged,
            "param_groups": inner["param_groups"][0],
            "commopt": state["ranks"][_diloco_key()][0],
        }
    )


def _replica_key(optimizer: CompressedOptimizer) -> str:
    """This rank's replica among R: ``"r<i>_of<R>"``."""
    sharding = optimizer.sharding
    if sharding is None:
        return "r0_of1"
    return f"r{sharding.replicate.rank}_of{sharding.replicate.world_size}"


def _replicas_agree(optimizer: CompressedOptimizer, own: dict[str, Any]) -> bool:
    """Whether every replica holds the same bits in its shards of ``own``: the model's and the
    optimizer's per-parameter state, as :func:`save_checkpoint` is about to write them
    (collective over the replicate group: one all-gather of a digest, the sums of the
    elements' bit patterns)."""
    sharding = optimizer.sharding
    if sharding is None or sharding.replicate.world_size == 1:
        return True
    tensors = list(own["model"].values())
    for entry in own["state"].values():
        tensors += list(entry.values())
    tensors = [local_shard(t) for t in tensors]
    sums = [
        t.detach().contiguous().view(-1).view(torch.uint8).sum(dtype=torch.int64)
        for t in tensors
        if torch.is_tensor(t) and t.numel() > 0
    ]
    mine = torch.stack(sums) if sums else torch.zeros(1, dtype=torch.int64)
    n = sharding.replicate.world_size
    everyone = torch.empty(n * mine.numel(), dtype=torch.int64, device=mine.device)
    sharding.replicate.all_gather(everyone, mine)
    rows = everyone.view(n, -1)
    return bool((rows == rows[0]).all())


def _rank_key(optimizer: CompressedOptimizer) -> str:
    """This rank's key among the per-rank entries: its layout (replicas × shards, position)."""
    sharding = optimizer.sharding
    layout = "whole" if sharding is None else sharding.name.replace(":", "_").replace(".", "_")
    return f"{layout}_rank{dist.get_rank()}"


def _as_dtensor(value: Any, p: torch.Tensor) -> Any:
    """A state tensor shaped like ``p``'s shard, as a DTensor like ``p`` (others unchanged)."""
    if not isinstance(p, DTensor) or not torch.is_tensor(value) or value.dim() == 0:
        return value
    if isinstance(value, DTensor):  # (an inner torch optimizer's state on FSDP2 parameters)
        return value
    return DTensor.from_local(
        value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )
