"""What the safe loader accepts: refuse, before anything is written, what it would not read.

:func:`~commopt.checkpoint.load_checkpoint` reads with ``torch.load(weights_only=True)``, which
refuses numpy values and arbitrary objects. :func:`check_loadable` finds such a value at save
time and names it, so that a checkpoint is never written that cannot be loaded back.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Mapping
from typing import Any

import torch

from commopt.checkpoint.manifest import CheckpointError, type_name

__all__ = ["UNLOADABLE_HINT", "check_loadable"]

UNLOADABLE_HINT = (
    "Store plain values instead: a numpy array as torch.from_numpy(a) or a.tolist(), a numpy "
    "scalar as x.item(), numpy's legacy np.random.get_state() as "
    "(s[0], torch.from_numpy(s[1]), *s[2:]) (or a Generator's bit_generator.state, a plain dict); "
    "other objects through their state_dict()"
)


def _skeleton(obj: Any) -> Any:
    """``obj`` with every tensor replaced by an empty one of its dtype, containers kept as they
    are (types included), so that pickling it costs nothing but checks everything the loader
    checks: the tensor data itself is always accepted.
    """
    if isinstance(obj, torch.Tensor):
        return torch.empty(0, dtype=obj.dtype)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps OrderedDict, defaultdict …: the loader judges the type too
        for k, v in obj.items():
            out[k] = _skeleton(v)
        return out
    if isinstance(obj, list):
        out = copy.copy(obj)
        out[:] = [_skeleton(v) for v in obj]
        return out
    if type(obj) is tuple:
        return tuple(_skeleton(v) for v in obj)
    return obj  # anything else is judged whole (a namedtuple, torch.Size, an arbitrary object)


def _safe_loads(obj: Any) -> bool:
    """Whether ``torch.load(weights_only=True)`` reads ``obj`` back after ``torch.save``."""
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
    except Exception:
        return False
    return True


def _children(obj: Any, where: str) -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [(f"{where}[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(f"{where}[{i}]", v) for i, v in enumerate(obj)]
    if isinstance(obj, (set, frozenset)):
        return [(f"an element of {where}", v) for v in obj]
    return []


def _first_unloadable(obj: Any, where: str) -> tuple[str, Any]:
    """The innermost value in ``obj`` that makes the safe loader refuse it (``obj`` must)."""
    for child_where, child in _children(obj, where):
        if not _safe_loads(child):
            return _first_unloadable(child, child_where)
    return where, obj  # the children load: the container's own type is refused


def check_loadable(parts: Mapping[str, Any]) -> None:
    """Raise CheckpointError naming the first value ``torch.load(weights_only=True)`` refuses.

    Exact by construction: the values (tensors emptied) go through the very same save and
    safe load that :func:`~commopt.checkpoint.load_checkpoint` will use.
    """
    skeleton = {name: _skeleton(v) for name, v in parts.items()}
    if _safe_loads(skeleton):
        return
    for name, part in skeleton.items():
        if not _safe_loads(part):
            where, value = _first_unloadable(part, name)
            break
    else:  # pragma: no cover - every part loads alone but not together: cannot happen
        where, value = "the checkpoint", skeleton
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    raise CheckpointError(
        f"save_checkpoint: {where} is a {type_name(value)} ({text}), which "
        "torch.load(weights_only=True) refuses, so the checkpoint could not be loaded back. "
        f"{UNLOADABLE_HINT}"
    )
