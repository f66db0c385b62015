"""What a checkpoint directory holds and how its manifest describes it.

``MANIFEST.json`` is written last: the format and its version, the versions of commopt and
torch, the optimizer type, the world size, the parameter and model shapes, which tensors were
saved per rank, and the size and SHA-256 of every file. A directory without it is not a
checkpoint; :func:`check_shapes` compares it with the model and optimizer being restored.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping
from typing import Any

import torch

from commopt._version import __version__

__all__ = [
    "DIGEST_BYTES",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "SHARED_NAME",
    "CheckpointError",
    "build_manifest",
    "check_shapes",
    "digest_row",
    "param_shapes",
    "read_manifest",
    "shard_name",
    "type_name",
]

FORMAT = "commopt-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "MANIFEST.json"
SHARED_NAME = "shared.pt"
DIGEST_BYTES = 32 + 8  # sha256 + little-endian size


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded; the message names what is wrong."""


def shard_name(rank: int, world_size: int) -> str:
    """File name of rank ``rank``'s shard in a checkpoint of ``world_size`` ranks."""
    return f"rank-{rank:05d}-of-{world_size:05d}.pt"


def type_name(obj: Any) -> str:
    """The qualified name of ``obj``'s type (the manifest's ``"optimizer"``, messages)."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def param_shapes(optimizer: torch.optim.Optimizer) -> list[list[list[int]]]:
    """The shape of every parameter, group by group."""
    return [[list(p.shape) for p in g["params"]] for g in optimizer.param_groups]


def digest_row(hexdigest: str, size: int) -> torch.Tensor:
    """A file's SHA-256 and size as :data:`DIGEST_BYTES` bytes (to gather them on rank 0)."""
    row = torch.zeros(DIGEST_BYTES, dtype=torch.uint8)
    row[:32] = torch.frombuffer(bytearray.fromhex(hexdigest), dtype=torch.uint8)
    row[32:] = torch.frombuffer(bytearray(size.to_bytes(8, "little")), dtype=torch.uint8)
    return row


def _file_entry(row: torch.Tensor) -> dict[str, Any]:
    raw = bytes(row.tolist())
    return {"sha256": raw[:32].hex(), "bytes": int.from_bytes(raw[32:], "little")}


def build_manifest(
    optimizer: torch.optim.Optimizer,
    model_sd: Mapping[str, Any],
    per_rank_model: list[str],
    per_rank_opt: list[tuple[int, str]],
    all_digests: torch.Tensor,
) -> dict[str, Any]:
    """The manifest of a checkpoint: ``all_digests[r]`` holds rank r's shard (row 0) and, on
    rank 0, the shared file (row 1), as :func:`digest_row` encodes them."""
    n = all_digests.shape[0]
    files_meta = {shard_name(r, n): _file_entry(all_digests[r, 0]) for r in range(n)}
    files_meta[SHARED_NAME] = _file_entry(all_digests[0, 1])
    global_state = getattr(optimizer, "global_state", None)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "commopt_version": __version__,
        "torch_version": torch.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "optimizer": type_name(optimizer),
        "world_size": n,
        "step": None if global_state is None else global_state.get("step"),
        "param_shapes": param_shapes(optimizer),
        "model_shapes": {
            k: list(v.shape) for k, v in model_sd.items() if isinstance(v, torch.Tensor)
        },
        "per_rank": {
            "model": per_rank_model,
            "optimizer": [[idx, key] for idx, key in per_rank_opt],
        },
        "files": files_meta,
    }


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``; CheckpointError if there is none, it cannot
    be read, or its format is not one this commopt understands."""
    if not os.path.isdir(path):
        hint = ""
        if os.path.isdir(path + ".old"):
            hint = f" ({path}.old holds the previous checkpoint of an interrupted save)"
        raise CheckpointError(f"no checkpoint directory at {path!r}{hint}")
    mpath = os.path.join(path, MANIFEST_NAME)
    if not os.path.isfile(mpath):
        raise CheckpointError(
            f"{path!r} has no {MANIFEST_NAME}: it is not a complete commopt checkpoint (the "
            "manifest is written last, so a save that did not finish has none); use another "
            "checkpoint"
        )
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{mpath!r} is not a readable manifest: {err}") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mpath!r} is not a commopt checkpoint manifest")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path!r} has format version {manifest['format_version']}, newer than this "
            f"commopt understands ({FORMAT_VERSION}); upgrade commopt"
        )
    return manifest


def check_shapes(manifest: Mapping[str, Any], model: Any, optimizer: Any, path: str) -> None:
    """CheckpointError unless the optimizer's parameters and the model's tensors have the
    shapes the manifest recorded (``model=None``: the model is not checked)."""
    saved = manifest["param_shapes"]
    have = param_shapes(optimizer)
    if [len(g) for g in saved] != [len(g) for g in have]:
        raise CheckpointError(
            f"parameter count per group differs: the checkpoint {path!r} has "
            f"{[len(g) for g in saved]}, this optimizer {[len(g) for g in have]}"
        )
    for gi, (sg, hg) in enumerate(zip(saved, have, strict=True)):
        for pi, (s, h) in enumerate(zip(sg, hg, strict=True)):
            if list(s) != list(h):
                raise CheckpointError(
                    f"parameter shapes do not match: param_groups[{gi}]['params'][{pi}] has shape "
                    f"{tuple(s)} in the checkpoint {path!r} but {tuple(h)} here"
                )
    if model is None:
        return
    saved_m = manifest["model_shapes"]
    have_m = {
        k: list(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)
    }
    missing = sorted(set(have_m) - set(saved_m))
    unexpected = sorted(set(saved_m) - set(have_m))
    if missing or unexpected:
        raise CheckpointError(
            f"model state keys do not match the checkpoint {path!r}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    for k, s in saved_m.items():
        if list(s) != have_m[k]:
            raise CheckpointError(
                f"model tensor {k!r} has shape {tuple(s)} in the checkpoint {path!r} but "
                f"{tuple(have_m[k])} here"
            )
