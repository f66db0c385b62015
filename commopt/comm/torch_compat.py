"""torch.distributed across the torch versions commopt supports (:data:`MIN_TORCH` and newer).

GPU clusters run the torch their CUDA stack was built with, often years older than the newest
release, so every ``torch.distributed`` call the package makes must exist in
:data:`MIN_TORCH`. Where a newer API is better it is looked up when called, with a fallback
that every supported version has:

- ``all_gather`` of equal pieces into one flat output: ``dist.all_gather_single`` where torch
  has it (newer than 2.11); else ``dist.all_gather_into_tensor`` on NCCL (every supported
  version); else ``dist.all_gather`` into views of the output, which gloo, MPI and every other
  process group implement in every supported version (gloo's flat variant is younger than some
  of them). All three move the same bytes into the same places: the result is bit-identical.

tests/unit/test_torch_compat.py checks every ``torch.distributed`` name the package touches
against the names torch 2.4 exports, and tests/multirank/test_torch_compat_gloo.py runs the
compressed exchange and the optimizers with the newer collectives hidden.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["MIN_TORCH", "all_gather_flat", "torch_version"]

#: the oldest torch commopt supports (pyproject.toml says the same)
MIN_TORCH = (2, 4)


def torch_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version`` (default: the running torch), e.g. "2.11.0+cu130" → (2, 11)."""
    text = torch.__version__ if version is None else version
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def all_gather_flat(
    out: torch.Tensor, t: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False
) -> dist.Work | None:
    """Gather every rank's ``t`` (1-D, contiguous) into ``out`` (1-D, world_size × t.numel(),
    rank r's piece at ``[r·k, (r+1)·k)``), with the best API this torch has (module docstring).
    Returns the work when ``async_op``."""
    single = getattr(dist, "all_gather_single", None)
    if single is not None:
        return single(out, t, group=group, async_op=async_op)
    into_tensor = getattr(dist, "all_gather_into_tensor", None)
    if into_tensor is not None and dist.get_backend(group) == "nccl":
        return into_tensor(out, t, group=group, async_op=async_op)
    pieces = list(out.view(dist.get_world_size(group), -1).unbind(0))
    return dist.all_gather(pieces, t, group=group, async_op=async_op)
