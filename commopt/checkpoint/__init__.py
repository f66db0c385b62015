r"""Sharded, atomic checkpoints of a model and a commopt optimizer.

A checkpoint is a directory::

    path/
      MANIFEST.json                 written last: format, versions, optimizer type, world size,
                                    parameter shapes, and the size and SHA-256 of every file
      shared.pt                     written once, by rank 0: the model and optimizer state that
                                    is identical on every rank
      rank-00000-of-00004.pt        one per rank: this rank's error buffers (the optimizer's
      rank-00001-of-00004.pt        ``"commopt"`` section), every tensor that differs between
      ...                           ranks, and this rank's ``extra`` values

What goes where is decided by the data, not by a list of names: at save time every rank hashes
each model and optimizer tensor and the hashes are compared with one all-reduce. A tensor equal
on every rank (the usual case: parameters, Adam moments) is written once; one that differs
(0/1 Adam's parameters and momentum between two synchronisations, a BatchNorm's running
statistics) is written in every rank's shard. The per-rank error buffers are always per rank.

Atomicity: every rank writes into ``<path>.tmp`` (each file through a temporary name, fsync,
rename); the ranks then agree that all writes succeeded, rank 0 writes ``MANIFEST.json`` with
the checksums of every file, fsyncs, and only then swaps the staging directory into ``path``.
A crash at any point leaves either the previous complete checkpoint or a directory without a
manifest, which :func:`load_checkpoint` refuses; a shard damaged after the fact fails its
checksum. Every rank must be able to read the files the others wrote (a shared filesystem).

Resume policy:

- same world size: everything is restored bit for bit, so training continues exactly as if it
  had not stopped (same data, same RNG state, which you pass in ``extra``);
- different world size: the per-rank error buffers are reset to zero (they describe a
  partition of the buffer into n chunks that no longer exists), tensors that differed between
  ranks are taken from rank 0's shard on every rank, ``extra`` is rank 0's, and everything else
  is restored exactly. A warning says so.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from collections.abc import Mapping
from typing import Any

import torch

# save and load call these two under their old private names, looked up in this module
from commopt.checkpoint.files import file_digest as _file_digest
from commopt.checkpoint.files import fsync_dir, replace_directory, write_json_atomic
from commopt.checkpoint.files import write_atomic as _write_atomic
from commopt.checkpoint.loadable import check_loadable
from commopt.checkpoint.manifest import (
    DIGEST_BYTES,
    FORMAT_VERSION,
    MANIFEST_NAME,
    SHARED_NAME,
    CheckpointError,
    build_manifest,
    check_shapes,
    digest_row,
    read_manifest,
    shard_name,
    type_name,
)
from commopt.checkpoint.manifest import FORMAT as FORMAT
from commopt.checkpoint.partition import partition_state
from commopt.comm import Backend, resolve_backend

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "CheckpointError",
    "load_checkpoint",
    "save_checkpoint",
    "shard_name",
]

logger = logging.getLogger(__name__)

CheckpointError.__module__ = __name__  # its public home, as tracebacks and docs name it


def _backend_of(optimizer: torch.optim.Optimizer, backend: Backend | None) -> Backend:
    if backend is not None:
        return backend
    be = getattr(optimizer, "backend", None)
    return be if be is not None else resolve_backend(None)


def _refuse_sharded(optimizer: torch.optim.Optimizer, what: str) -> None:
    """CheckpointError (on every rank: they all step shards) for an optimizer of FSDP2 shards,
    whose state this format, written once where ranks agree, would not keep per shard."""
    if getattr(optimizer, "sharding", None) is not None:
        raise CheckpointError(
            f"{what}: this {type(optimizer).__name__} steps FSDP2 shards (commopt.fsdp); save "
            "and load it with commopt.fsdp.save_checkpoint / commopt.fsdp.load_checkpoint "
            "(torch.distributed.checkpoint), which keep each shard's state"
        )


def _agree_ok(be: Backend, ok: bool) -> list[int]:
    """All ranks learn which ranks failed (one all-gather). Returns the failed ranks."""
    if be.world_size == 1:
        return [] if ok else [0]
    flags = torch.empty(be.world_size, dtype=torch.int64)
    be.all_gather(flags, torch.tensor([0 if ok else 1], dtype=torch.int64))
    return [r for r, f in enumerate(flags.tolist()) if f]


# -- save -----------------------------------------------------------------------------------------
def save_checkpoint(
    path: str | os.PathLike[str],
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer,
    *,
    backend: Backend | None = None,
    **extra: Any,
) -> None:
    """Save ``model``, ``optimizer`` and ``extra`` to the directory ``path``; every rank calls it.

    Collective: all ranks must call it with the same ``path``. The previous checkpoint at
    ``path``, if any, is replaced only once the new one is complete.

    Args:
        path: the checkpoint directory (created; replaced if it exists).
        model: the module whose ``state_dict()`` is saved, or ``None``.
        optimizer: a commopt optimizer (its per-rank error buffers go into this rank's shard)
            or any ``torch.optim.Optimizer``.
        backend: where to communicate; default the optimizer's backend.
        **extra: anything else to restore (step, data position, RNG states, a scheduler's
            ``state_dict()``): plain containers of tensors, numbers and strings, which
            ``torch.load(weights_only=True)`` accepts. Saved per rank; :func:`load_checkpoint`
            returns this rank's. Anything the safe loader would refuse (a numpy array or
            scalar, ``np.random.get_state()``, an arbitrary object) is refused here, before
            anything is written, naming the key and the type; convert it first (the message
            says how).

    Raises:
        CheckpointError: a value (in ``extra``, or in the model's or optimizer's state dict)
            that ``torch.load(weights_only=True)`` would refuse, or a rank failed to write;
            raised on every rank, naming the ranks. The previous checkpoint at ``path`` is
            left as it was.
    """
    _refuse_sharded(optimizer, "save_checkpoint")
    be = _backend_of(optimizer, backend)
    rank, n = be.rank, be.world_size
    path = os.path.normpath(os.fspath(path))  # "ckpt/" is "ckpt": the staging is "ckpt.tmp"
    staging = path + ".tmp"

    # 1. Split the state: tensors equal on every rank are written once, the rest per rank.
    model_sd = dict(model.state_dict()) if model is not None else {}
    part = partition_state(model_sd, optimizer.state_dict(), extra, be)
    shard, shared = part.shard, part.shared

    # 2. Check that the safe loader will read every file back, then stage: rank 0 clears the
    #    staging directory, everyone writes its file. Nothing at ``path`` changes before the
    #    ranks agree that all of this worked.
    error: BaseException | None = None
    try:
        parts = {
            "extra": shard["extra"],
            "optimizer.state_dict()['commopt']": shard["commopt"],
            "model.state_dict()": shard["model"],
            "optimizer.state_dict()['state']": shard["optimizer_state"],
        }
        if shared is not None:
            parts["model.state_dict() "] = shared["model"]
            parts["optimizer.state_dict() "] = shared["optimizer"]
        check_loadable(parts)
        if rank == 0:
            if os.path.exists(staging):
                shutil.rmtree(staging)
            os.makedirs(staging)
    except (OSError, CheckpointError) as err:
        error = err
    failed = _agree_ok(be, error is None)
    if failed:
        if isinstance(error, CheckpointError):
            raise CheckpointError(f"{error}; nothing was written, {path!r} was left as it was")
        if error is None and any(r != 0 for r in failed):
            raise CheckpointError(
                f"save_checkpoint: rank(s) {failed} refused their values (see their error); "
                f"nothing was written, {path!r} was left as it was"
            )
        raise CheckpointError(
            f"save_checkpoint: rank 0 could not create the staging directory {staging!r}"
            + (f": {error}" if error else "")
        ) from error

    digests = torch.zeros(2, DIGEST_BYTES, dtype=torch.uint8)
    try:
        files = [(0, shard_name(rank, n), shard)]
        if shared is not None:
            files.append((1, SHARED_NAME, shared))
        for slot, name, obj in files:
            digests[slot] = digest_row(*_write_atomic(obj, staging, name))
        fsync_dir(staging)
    except Exception as err:  # report on every rank instead of leaving the others waiting
        error = err
    failed = _agree_ok(be, error is None)
    if failed:
        raise CheckpointError(
            f"save_checkpoint: writing the shards failed on rank(s) {failed}"
            + (f" (here: {type(error).__name__}: {error})" if error else "")
            + f"; {path!r} was left as it was"
        ) from error

    # 3. Rank 0 collects every digest, writes the manifest last, then swaps the directory in.
    all_digests = torch.empty(n, 2, DIGEST_BYTES, dtype=torch.uint8)
    if n > 1:
        be.all_gather(all_digests, digests)
    else:
        all_digests[0] = digests
    if rank == 0:
        try:
            manifest = build_manifest(
                optimizer, model_sd, part.per_rank_model, part.per_rank_opt, all_digests
            )
            write_json_atomic(manifest, staging, MANIFEST_NAME)
            replace_directory(staging, path)
        except Exception as err:
            error = err
    failed = _agree_ok(be, error is None)
    if failed:
        raise CheckpointError(
            f"save_checkpoint: rank 0 could not write the manifest or move {staging!r} to "
            f"{path!r}" + (f": {type(error).__name__}: {error}" if error else "")
        ) from error
    logger.info("rank %d: checkpoint saved to %s", rank, path)


# -- load -----------------------------------------------------------------------------------------
def _read_verified(path: str, name: str, manifest: Mapping[str, Any]) -> Any:
    meta = manifest["files"].get(name)
    if meta is None:
        raise CheckpointError(f"the manifest of {path!r} lists no file {name!r}")
    fpath = os.path.join(path, name)
    if not os.path.isfile(fpath):
        raise CheckpointError(f"{name} is missing from {path!r} (the manifest lists it)")
    size = os.path.getsize(fpath)
    if size != meta["bytes"]:
        what = "truncated" if size < meta["bytes"] else "longer than recorded"
        raise CheckpointError(
            f"{name} in {path!r} is {what}: {size} bytes, the manifest says {meta['bytes']}"
        )
    digest, _ = _file_digest(fpath)
    if digest != meta["sha256"]:
        raise CheckpointError(
            f"{name} in {path!r} is corrupt: its SHA-256 {digest[:16]}… differs from the "
            f"manifest's {meta['sha256'][:16]}…"
        )
    try:
        return torch.load(fpath, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(f"{name} in {path!r} cannot be read: {err}") from err


def _optimizer_state(
    shared: dict[str, Any],
    shard: dict[str, Any],
    manifest: Mapping[str, Any],
    saved_n: int,
    n: int,
    rank: int,
    path: str,
) -> tuple[dict[str, Any], str | None]:
    """The optimizer's state dict put back together from the shared file and this rank's shard,
    and the warning for a changed world size (None when it is the same)."""
    opt_sd: dict[str, Any] = shared["optimizer"]
    for idx, st in shard["optimizer_state"].items():
        opt_sd["state"].setdefault(idx, {}).update(st)
    comm = shard["commopt"]
    warning = None
    if saved_n != n:
        per_rank = manifest["per_rank"]
        n_per_rank = len(per_rank["model"]) + len(per_rank["optimizer"])
        warning = (
            f"checkpoint {path!r} was saved at world size {saved_n} and is loaded at {n}: the "
            "per-rank error buffers are reset to zero"
            + (
                f", {n_per_rank} tensor(s) that differed between ranks are taken from rank 0's "
                "shard"
                if n_per_rank
                else ""
            )
            + ", the extra values are rank 0's; everything else is restored exactly"
        )
        if comm is not None:
            comm = {**comm, "world_size": n, "rank": rank, "buckets": []}
    if comm is not None:
        opt_sd["commopt"] = comm
    return opt_sd, warning


def load_checkpoint(
    path: str | os.PathLike[str],
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer,
    *,
    backend: Backend | None = None,
    allow_config_change: bool = False,
) -> dict[str, Any]:
    """Restore ``model`` and ``optimizer`` from a :func:`save_checkpoint` directory.

    Collective: every rank calls it. Everything is read and verified first, including whether
    the optimizer accepts its state (a commopt optimizer's ``check_state_dict``: the schedule,
    the bucket layout); the ranks agree that all of them succeeded, and only then is anything
    changed, so a refused checkpoint raises on every rank and leaves the model and optimizer
    bitwise as they were.

    Args:
        path: the checkpoint directory.
        model: the module to restore, or ``None`` (must match what was saved).
        optimizer: an optimizer of the type that saved the checkpoint, over parameters of the
            same shapes.
        backend: where to communicate; default the optimizer's backend.
        allow_config_change: passed to a commopt optimizer's ``load_state_dict``: resume under
            this optimizer's config (say another ``freeze_step``) on purpose, with a warning.

    Returns:
        The ``extra`` keyword arguments given to :func:`save_checkpoint` on this rank (on
        rank 0 when the world size changed).

    Raises:
        CheckpointError: missing directory or manifest, another optimizer type, mismatched
            parameter or model shapes, a missing, truncated or corrupt shard, an optimizer
            state the optimizer refuses (another schedule, another ``bucket_numel``) — on every
            rank, with the failing rank's reason.
    """
    _refuse_sharded(optimizer, "load_checkpoint")
    be = _backend_of(optimizer, backend)
    rank, n = be.rank, be.world_size
    path = os.path.normpath(os.fspath(path))

    error: BaseException | None = None
    try:
        manifest = read_manifest(path)
        if manifest["optimizer"] != type_name(optimizer):
            raise CheckpointError(
                f"{path!r} was saved by a {manifest['optimizer']} optimizer and cannot be loaded "
                f"into a {type_name(optimizer)}: their states mean different things; build a "
                f"{manifest['optimizer'].rsplit('.', 1)[-1]} to resume from it"
            )
        check_shapes(manifest, model, optimizer, path)
        saved_n = int(manifest["world_size"])
        source = rank if saved_n == n else 0
        shared = _read_verified(path, SHARED_NAME, manifest)
        shard = _read_verified(path, shard_name(source, saved_n), manifest)
        opt_sd, warning = _optimizer_state(shared, shard, manifest, saved_n, n, rank, path)
        check = getattr(optimizer, "check_state_dict", None)  # commopt's: dry-run the load
        if check is not None:
            try:
                check(opt_sd, allow_config_change=allow_config_change)
            except ValueError as err:
                raise CheckpointError(
                    f"{path!r} cannot be loaded into this optimizer (nothing was changed): {err}"
                ) from err
        elif allow_config_change:
            raise TypeError(
                "allow_config_change applies to commopt optimizers; "
                f"{type(optimizer).__name__} has no config to change"
            )
    except Exception as err:
        error = err
    failed = _agree_ok(be, error is None)
    if failed:
        if error is not None:
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"load_checkpoint: {type(error).__name__}: {error}") from error
        raise CheckpointError(
            f"load_checkpoint: loading {path!r} failed on rank(s) {failed} (see their error); "
            "nothing was changed"
        )

    # Every rank verified its files and its optimizer accepts the state: apply, the optimizer
    # first (it validated; torch's own optimizers validate before they change anything), then
    # the model, whose keys and shapes were checked against the manifest.
    if warning is not None:
        warnings.warn(warning, stacklevel=2)
    if check is not None:
        load = optimizer.load_state_dict
        load(opt_sd, allow_config_change=allow_config_change)  # type: ignore[call-arg]
    else:
        optimizer.load_state_dict(opt_sd)
    if model is not None:
        model.load_state_dict({**shared["model"], **shard["model"]})
    logger.info("rank %d: checkpoint loaded from %s (saved at world size %d)", rank, path, saved_n)
    return dict(shard["extra"])
