"""Every rank checks that every other rank built the same outer loop, before any sync can hang.

Ranks that disagree on ``sync_every`` would enter the pseudo-gradient's collectives at
different steps: one rank waits in a collective the others never start (or, worse, pairs it
with a later, unrelated one). One all-gather of a few integers when the loop is built turns
that into a ``ValueError`` on every rank that names the setting and each rank's value.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

import torch

from commopt.comm import Backend

__all__ = ["agree", "float_bits"]


def float_bits(x: float) -> int:
    """The IEEE-754 binary64 bits of ``x`` as an int64 (so floats compare exactly)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def agree(backend: Backend, fields: Mapping[str, int], what: str) -> None:
    """Raise ``ValueError`` on every rank unless every rank passed the same ``fields``.

    Args:
        backend: the ranks that must agree (one all-gather of ``len(fields)`` int64 per rank).
        fields: setting name → integer value (floats through :func:`float_bits`).
        what: the object being built, for the message.
    """
    n = backend.world_size
    if n == 1:
        return
    names = list(fields)
    mine = torch.tensor([int(fields[k]) for k in names], dtype=torch.int64)
    table = torch.empty(n * len(names), dtype=torch.int64)
    backend.all_gather(table, mine)
    rows = table.view(n, len(names)).tolist()
    differ = [i for i, k in enumerate(names) if len({row[i] for row in rows}) > 1]
    if differ:
        detail = "; ".join(
            f"{names[i]}: " + ", ".join(f"rank {r} {row[i]}" for r, row in enumerate(rows))
            for i in differ
        )
        raise ValueError(
            f"{what}: the ranks were built with different settings ({detail}); every rank must "
            "pass the same ones (floats are compared by their bits)"
        )
