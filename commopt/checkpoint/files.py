"""Writing a checkpoint's files so that a crash never leaves a half-written one in place.

Each file goes through a temporary name, fsync and rename, and its SHA-256 and size are taken
for the manifest; the manifest is written the same way, last, and only then does the staging
directory replace the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any

import torch

__all__ = ["file_digest", "fsync_dir", "replace_directory", "write_atomic", "write_json_atomic"]


def fsync_dir(path: str) -> None:
    """fsync a directory (its entries: the renames into it), where the platform allows."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: str) -> tuple[str, int]:
    """The SHA-256 (hex) and the size in bytes of the file at ``path``."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def write_atomic(obj: Any, directory: str, name: str) -> tuple[str, int]:
    """torch.save ``obj`` to ``directory/name`` via a temporary name, fsync, rename; digest."""
    final = os.path.join(directory, name)
    tmp = os.path.join(directory, f".{name}.partial")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    digest = file_digest(tmp)
    os.replace(tmp, final)
    return digest


def write_json_atomic(obj: Any, directory: str, name: str) -> None:
    """``obj`` as JSON to ``directory/name`` via a temporary name, fsync, rename."""
    tmp = os.path.join(directory, f".{name}.partial")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, name))
    fsync_dir(directory)


def replace_directory(staging: str, path: str) -> None:
    """Move the complete ``staging`` directory to ``path``; an existing ``path`` is moved to
    ``path.old`` first and removed once the new one is in place."""
    old = path + ".old"
    if os.path.exists(path):
        if os.path.exists(old):
            shutil.rmtree(old)
        os.replace(path, old)
    os.replace(staging, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    if os.path.exists(old):
        shutil.rmtree(old)
