"""The compressed exchange on a GPU synchronises the host once per call, in the agreement.

Phase 1a (SPEC §1 step 3) reads the all-gathered (s, L, safe?) table on the host: it is what
lets every rank raise NonFiniteError alike before e or f change. Nothing else in the exchange may
wait for the device: no ``.item()``, no blocking copy, no stream sync in the kernels or the
wrappers. Run under ``torch.cuda.set_sync_debug_mode("warn")``, which turns each synchronising
call into a warning at the Python line that made it.

One process and one GPU: :class:`MirrorBackend` is a world of n identical ranks (each collective
returns what n copies of this rank would send), so the whole exchange runs with no peer.
"""

from __future__ import annotations

import warnings

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible to torch", allow_module_level=True)
pytest.importorskip("cupy", reason="CuPy is not installed (the `cuda` extra)")

from commopt.comm.base import CommStats, check_equal_split
from commopt.compressed import compressed_allreduce, padded_size

DEV = torch.device("cuda")


class MirrorBackend:
    """n ranks that all hold this rank's data; rank 0 of them."""

    name = "mirror"
    rank = 0

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.stats = CommStats()

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return t.mul_(self.world_size) if op == "sum" else t

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        check_equal_split("all_gather", out, t, self.world_size)
        out.view(self.world_size, -1).copy_(t.view(1, -1).expand(self.world_size, -1))
        return out

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        check_equal_split("all_to_all", out, t, self.world_size)
        rows = t.view(self.world_size, -1)[self.rank]  # what every rank sends to rank 0
        out.view(self.world_size, -1).copy_(rows.view(1, -1).expand(self.world_size, -1))
        return out

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        return t

    def barrier(self) -> None:
        return None


@pytest.mark.parametrize("pipeline", [1, 3])
def test_one_host_synchronisation_per_call_in_the_agreement(pipeline):
    n, numel = 4, 3 * (1 << 20) + 5
    padded = padded_size(numel, n)
    x = torch.randn(numel, device=DEV)
    e, f = torch.zeros(padded, device=DEV), torch.zeros(padded // n, device=DEV)
    out = torch.empty_like(x)
    backend = MirrorBackend(n)
    compressed_allreduce(x, e, f, backend, out=out, pipeline=pipeline)  # compile, workspace
    torch.cuda.synchronize()
    calls = 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(calls):
                compressed_allreduce(x, e, f, backend, out=out, pipeline=pipeline)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    where = [f"{w.filename}:{w.lineno}" for w in syncs]
    assert len(syncs) == calls, where
    assert all(w.filename.endswith("compressed.py") for w in syncs), where
    assert torch.isfinite(out).all()
