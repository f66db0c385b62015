"""The ranks agree on the hyperparameters: a digest in every step's agreement, a clear error.

Ranks built with different ``lr``, ``betas`` or ``weight_decay`` (a typo in one launcher's
arguments, a learning-rate scheduler stepped on a per-rank metric) take different steps from
the same averaged gradients, and their replicas drift apart without a word. The per-step
agreement (:mod:`._agreement`) already sends a few integers; one more pair carries a 63-bit
digest of every setting — the config and each param group's options — so that a difference is
found at the first communicating step after it appears, at the cost of hashing a few dozen
short strings. Only then is the difference located (two more small collectives) and raised,
naming the setting and every rank's value, on every rank alike.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from commopt.comm import Backend

__all__ = ["check_same_settings", "settings_items", "settings_key"]

_VALUE_BYTES = 48  # how much of each rank's value the error message shows


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


def check_same_settings(backend: Backend, items: Sequence[tuple[str, str]], owner: str) -> None:
    """Raise the same ValueError on every rank unless every rank has the same ``items``.

    Collective: the count, then each item's hash (max and min in one all-reduce each); at the
    first difference, every rank's value is all-gathered for the message.
    """
    be = backend
    if be.world_size == 1:
        return
    count = torch.tensor([len(items), -len(items)], dtype=torch.int64)
    be.all_reduce(count, "max")
    largest, common = int(count[0]), int(-count[1])
    hashes = torch.tensor([_hash(f"{n}={v}") for n, v in items[:common]], dtype=torch.int64)
    both = torch.cat([hashes, -hashes])
    be.all_reduce(both, "max")
    differ = (both[:common] != -both[common:]).nonzero()
    if not len(differ) and largest == common:
        return  # a digest collision: nothing differs
    i = int(differ[0]) if len(differ) else common
    name = items[i][0] if i < len(items) else f"setting #{i}"
    mine = (items[i][1] if i < len(items) else "(absent)").encode()[:_VALUE_BYTES]
    raw = torch.zeros(_VALUE_BYTES, dtype=torch.uint8)
    raw[: len(mine)] = torch.tensor(list(mine), dtype=torch.uint8)
    gathered = torch.empty(be.world_size * _VALUE_BYTES, dtype=torch.uint8)
    be.all_gather(gathered, raw)
    values = [
        bytes(row[row != 0].tolist()).decode(errors="replace")
        for row in gathered.view(be.world_size, _VALUE_BYTES)
    ]
    what = (
        f"{name} differs between ranks: " + ", ".join(f"rank {r} {v}" for r, v in enumerate(values))
        if largest == common
        else f"the param groups hold different options on different ranks (first at {name}: "
        + ", ".join(f"rank {r} {v}" for r, v in enumerate(values))
        + ")"
    )
    raise ValueError(
        f"{owner}: {what}. Every rank must build the optimizer with the same hyperparameters "
        "and change them alike (the same scheduler, stepped on a metric all ranks share): with "
        "different ones the replicas drift apart"
    )
