"""The selection table of :class:`~commopt.comm.MixedBackend`: schema, loading, validation, lookup.

A table is a JSON object (``commopt tune`` writes one; ``docs/mixed-backend.md`` documents every
field). Only three fields decide anything:

``format``
    ``"commopt-selection-table"``; ``version`` is ``1``.
``default``
    the backend used where no rule matches (barriers, dtypes the table does not name).
``rules``
    a list of ``{"op", "dtype", "min_bytes", "max_bytes", "backend"}``: message sizes
    ``min_bytes ≤ size < max_bytes`` of operation ``op`` on tensors of ``dtype`` go to
    ``backend``; ``max_bytes: null`` means no upper end, ``dtype: "*"`` any dtype. For each
    (op, dtype) pair the ranges must tile ``[0, ∞)`` exactly: start at 0, no gaps, no overlaps,
    end with ``null``.

Lookup of (op, size, dtype): the rules of (op, dtype), else those of (op, ``"*"``), else
``default``. Everything else in the table (world size, versions, measured times) is there so a
reader can audit the choice; it is carried along but never consulted.
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Collection, Mapping
from typing import Any

import torch

__all__ = [
    "TABLE_FORMAT",
    "TABLE_OPERATIONS",
    "TABLE_VERSION",
    "SelectionTable",
    "canonical_json",
    "dtype_name",
    "load_table",
]

TABLE_FORMAT = "commopt-selection-table"
TABLE_VERSION = 1
#: operations a rule may name (the Backend protocol's, barrier included)
TABLE_OPERATIONS = ("all_reduce", "all_gather", "all_to_all", "broadcast", "barrier")
_RULE_KEYS = {"op", "dtype", "min_bytes", "max_bytes", "backend"}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` → ``"float32"``: the spelling rules use."""
    return str(dtype).removeprefix("torch.")


def canonical_json(table: Mapping[str, Any]) -> str:
    """One spelling per table (sorted keys, no spaces), so equal tables compare equal as text."""
    return json.dumps(table, sort_keys=True, separators=(",", ":"), allow_nan=False)


def load_table(source: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """Read a table from a dict (copied) or a JSON file; no validation beyond "it is an object".

    Raises:
        ValueError: the file is missing or unreadable (a directory, no permission), is not
            JSON, is nested too deeply to parse, or holds something other than an object.
        TypeError: ``source`` is neither a mapping nor a path.
    """
    if isinstance(source, Mapping):
        try:
            return json.loads(json.dumps(dict(source)))  # deep copy, and proves it is JSON-able
        except RecursionError:
            raise ValueError("selection table is nested too deeply to be one") from None
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"table must be a dict or a path to a JSON file, got {type(source).__name__}"
        )
    path = os.fspath(source)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(
            f"selection table {path!r} does not exist; write one with `commopt tune -o {path}`"
        ) from None
    except json.JSONDecodeError as err:
        raise ValueError(f"selection table {path!r} is not valid JSON: {err}") from None
    except OSError as err:  # a directory, no permission, an I/O error
        raise ValueError(f"selection table {path!r} cannot be read: {err}") from None
    except RecursionError:
        raise ValueError(f"selection table {path!r} is nested too deeply to be one") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"selection table {path!r} must hold a JSON object, got {type(data).__name__}"
        )
    return data


def _int_bound(where: str, key: str, value: Any, allow_none: bool) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        allowed = "a non-negative integer or null" if allow_none else "a non-negative integer"
        raise ValueError(f"selection table: {where}: {key} must be {allowed}, got {value!r}")
    return value


class SelectionTable:
    r"""A validated selection table: ``select(op, nbytes, dtype)`` names the backend to use.

    Args:
        table: the table object (see the module docstring).
        available: the backend names that exist; a rule or ``default`` naming another is an
            error. ``None`` skips that check.

    Raises:
        ValueError: wrong format or version, a missing or ill-typed field, an unknown operation,
            a backend that is not available, or size ranges of one (op, dtype) that do not tile
            ``[0, ∞)`` (gap, overlap, not starting at 0, bounded last range).
    """

    def __init__(self, table: Mapping[str, Any], available: Collection[str] | None = None) -> None:
        if not isinstance(table, Mapping):
            raise ValueError(f"selection table must be a JSON object, got {type(table).__name__}")
        if table.get("format") != TABLE_FORMAT:
            raise ValueError(
                f"selection table: format must be {TABLE_FORMAT!r}, got {table.get('format')!r} "
                "(is this a table written by `commopt tune`?)"
            )
        if table.get("version") != TABLE_VERSION:
            raise ValueError(
                f"selection table: version {table.get('version')!r} is not supported "
                f"(this commopt reads version {TABLE_VERSION}); re-run `commopt tune`"
            )
        self.table = dict(table)
        known = sorted(available) if available is not None else None

        def check_backend(where: str, name: Any) -> str:
            if not isinstance(name, str):
                raise ValueError(
                    f"selection table: {where}: backend must be a string, got {name!r}"
                )
            if known is not None and name not in known:
                raise ValueError(
                    f"selection table: {where} names backend {name!r}, which is not available "
                    f"here (available: {known}); pass it to MixedBackend or re-run `commopt tune` "
                    "with the backends this job has"
                )
            return name

        self.default = check_backend("'default'", table.get("default"))
        rules = table.get("rules")
        if not isinstance(rules, list):
            raise ValueError(f"selection table: 'rules' must be a list, got {type(rules).__name__}")
        grouped: dict[tuple[str, str], list[tuple[int, int | None, str, int]]] = {}
        for i, rule in enumerate(rules):
            where = f"rules[{i}]"
            if not isinstance(rule, Mapping):
                raise ValueError(f"selection table: {where} must be an object, got {rule!r}")
            missing = _RULE_KEYS - set(rule)
            if missing:
                raise ValueError(
                    f"selection table: {where} lacks {sorted(missing)}; every rule needs "
                    f"{sorted(_RULE_KEYS)}"
                )
            op = rule["op"]
            if op not in TABLE_OPERATIONS:
                raise ValueError(
                    f"selection table: {where}: unknown op {op!r}; expected one of "
                    f"{TABLE_OPERATIONS}"
                )
            dtype = rule["dtype"]
            if not isinstance(dtype, str) or not (dtype == "*" or _is_dtype(dtype)):
                raise ValueError(
                    f"selection table: {where}: dtype must be '*' or a torch dtype name such as "
                    f"'float32', got {dtype!r}"
                )
            lo = _int_bound(where, "min_bytes", rule["min_bytes"], allow_none=False)
            hi = _int_bound(where, "max_bytes", rule["max_bytes"], allow_none=True)
            if hi is not None and hi <= lo:  # type: ignore[operator]
                raise ValueError(
                    f"selection table: {where}: empty range min_bytes={lo} >= max_bytes={hi}"
                )
            name = check_backend(where, rule["backend"])
            grouped.setdefault((op, dtype), []).append((lo, hi, name, i))  # type: ignore[arg-type]

        # (op, dtype) → (sorted lower bounds, backends) for bisect.
        self._ranges: dict[tuple[str, str], tuple[list[int], list[str]]] = {}
        for (op, dtype), items in grouped.items():
            items.sort(key=lambda r: r[0])
            expected = 0
            for lo, hi, _, i in items:
                if expected is not None and lo > expected:
                    raise ValueError(
                        f"selection table: sizes of ({op}, {dtype}) have a gap: nothing covers "
                        f"[{expected}, {lo}) bytes (rules[{i}] starts at {lo}); ranges must tile "
                        "[0, ∞) with min_bytes of each equal to max_bytes of the previous"
                    )
                if expected is None or lo < expected:
                    end = "∞ (max_bytes null)" if expected is None else expected
                    raise ValueError(
                        f"selection table: sizes of ({op}, {dtype}) overlap: rules[{i}] starts at "
                        f"{lo} bytes but the previous range ends at {end}"
                    )
                expected = hi
            if expected is not None:
                raise ValueError(
                    f"selection table: sizes of ({op}, {dtype}) have a gap: nothing covers "
                    f"[{expected}, ∞); the last range must have max_bytes null"
                )
            self._ranges[(op, dtype)] = ([r[0] for r in items], [r[2] for r in items])
        self._cache: dict[tuple[str, int, str], str] = {}

    @property
    def backends(self) -> set[str]:
        """Every backend name the table can select."""
        names = {self.default}
        for _, chosen in self._ranges.values():
            names.update(chosen)
        return names

    def select(self, op: str, nbytes: int, dtype: torch.dtype | str | None = None) -> str:
        """The backend for ``op`` on a message of ``nbytes`` bytes of ``dtype``.

        A pure function of its arguments (and the table), so every rank that holds the same
        table makes the same choice for the same call.
        """
        dname = "*" if dtype is None else dtype if isinstance(dtype, str) else dtype_name(dtype)
        key = (op, nbytes, dname)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        ranges = self._ranges.get((op, dname)) or self._ranges.get((op, "*"))
        if ranges is None:
            chosen = self.default
        else:
            starts, names = ranges
            chosen = names[bisect.bisect_right(starts, nbytes) - 1]
        if len(self._cache) < 4096:
            self._cache[key] = chosen
        return chosen


def _is_dtype(name: str) -> bool:
    return isinstance(getattr(torch, name, None), torch.dtype)
