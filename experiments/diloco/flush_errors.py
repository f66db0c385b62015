# ruff: noqa: E402  (torch is imported after its CPU kernels are capped, below)
r"""Does paying the error feedback's debt at the end help? (rejected; recorded in
docs/algorithms/diloco.md, then removed)

    python -m experiments.diloco.flush_errors --task digits --seeds 0,1,2 \
        --optimizers DiLoCo-onebit-H10-tensor,DiLoCo-onebit-H50-tensor,DiLoCo-onebit-H100-tensor

After ``DiLoCo.finish()``, what the 1-bit exchange still owes (the mean of the worker errors
plus the servers' errors, exactly what the compressed averages have not delivered) is
all-reduced in fp32 and applied to the anchor with the outer lr. Flat exchange only. Otherwise
``experiments.diloco.convergence`` unchanged (same arguments, same table).
"""

from __future__ import annotations

from experiments.cpu_isa import cap_at_avx2

cap_at_avx2()

import sys

import torch

from commopt.diloco.outer import DiLoCo
from experiments.diloco import convergence

_FINISH = DiLoCo.finish


@torch.no_grad()
def _finish_and_flush(self: DiLoCo) -> None:
    _FINISH(self)
    if self.average.name != "onebit":
        return
    be, n = self.backend, self.backend.world_size
    for frag in self.parts:
        debt = torch.zeros_like(frag.anchor)
        for (offset, numel), state in zip(frag.segments, frag.states, strict=True):
            worker = state["worker_error"].clone()
            be.all_reduce(worker, "avg")
            server = state["server_error"]
            servers = torch.empty(server.numel() * n, dtype=server.dtype)
            be.all_gather(servers, server)
            debt[offset : offset + numel] = (worker + servers)[:numel]
        frag.anchor.add_(debt, alpha=-self.outer_lr)
        frag.load_params_()


if __name__ == "__main__":
    DiLoCo.finish = _finish_and_flush  # (inherited by the forked ranks)
    sys.exit(convergence.main())
