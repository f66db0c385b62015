"""``comm_stats()["compression_error"]`` stays finite and in [0, √2) for finite momenta near
1e18, where the fp32 dot product of the error buffer overflows (it was inf)."""

from __future__ import annotations

import math

import torch

import commopt
from tests.multirank.harness import run_ranks


def _huge(backend) -> list[float | None]:
    w = torch.nn.Parameter(torch.zeros(4096))
    opt = commopt.OnebitAdam([w], lr=1e-3, freeze_step=1, backend=backend)
    gen = torch.Generator().manual_seed(backend.rank)
    errors = []
    for _ in range(3):
        w.grad = torch.randn(4096, generator=gen) * 1e19
        opt.step()
        errors.append(opt.comm_stats()["compression_error"])
    return errors


def test_compression_error_is_finite_for_huge_momenta() -> None:
    for errors in run_ranks(_huge, 2, timeout=120):
        assert errors[0] is None  # the warmup step compresses nothing
        for e in errors[1:]:
            assert e is not None and math.isfinite(e) and 0.0 <= e < math.sqrt(2), errors
