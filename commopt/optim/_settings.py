"""The ranks agree on the hyperparameters: a digest in every step's agreement, a clear error.

Ranks built with different ``lr``, ``betas`` or ``weight_decay`` (a typo in one launcher's
arguments, a learning-rate scheduler stepped on a per-rank metric) take different steps from
the same averaged gradients, and their replicas drift apart without a word. The per-step
agreement (:mod:`._agreement`) already sends a few integers; one more pair carries a 63-bit
digest of every setting — the config and each param group's options — so that a difference is
found at the first communicating step after it appears, at the cost of hashing a few dozen
short strings. Only then is the difference located (``check_same_settings`` in
:mod:`._agreement`: two more small collectives) and raised, naming the setting and every rank's
value, on every rank alike.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["item_key", "settings_items", "settings_key"]


def _text(value: Any) -> str:
    """A value as text that is equal exactly when the values are (floats: repr round-trips)."""
    if isinstance(value, torch.Tensor):
        return f"tensor({value.detach().cpu().tolist()!r})"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_text(v) for v in value) + ")"
    return repr(value)


def settings_items(config: Any, param_groups: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """(name, value as text) of every field of ``config`` and every option of every param group
    (its parameters aside), in a fixed order."""
    items = [(f.name, _text(getattr(config, f.name))) for f in dataclasses.fields(config)]
    for gi, group in enumerate(param_groups):
        for key in sorted(k for k in group if k != "params"):
            items.append((f"param_groups[{gi}][{key!r}]", _text(group[key])))
    return items


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def settings_key(items: Sequence[tuple[str, str]]) -> int:
    """63-bit digest of :func:`settings_items`."""
    return _hash("\n".join(f"{name}={value}" for name, value in items))


def item_key(name: str, value: str) -> int:
    """63-bit digest of one item (to locate a difference item by item)."""
    return _hash(f"{name}={value}")
