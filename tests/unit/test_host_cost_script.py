"""experiments/kernels/host_cost.py runs (a small size), and its null runtime is launched
once per kernel call, so the figure it prints is the wrapper's cost per call."""

from __future__ import annotations

import torch

from commopt.kernels.cupy_kernels import CupyKernels
from experiments.kernels import host_cost


def test_host_cost_prints_each_call(capsys) -> None:
    host_cost.main(["--numel", "4096", "--calls", "10"])
    out = capsys.readouterr().out
    for name in ("scale", "pack_compensated_", "server_reduce_", "unpack_scaled_"):
        assert name in out


def test_the_null_runtime_sees_every_launch() -> None:
    runtime = host_cost.NullRuntime()
    CupyKernels(runtime).scale(torch.randn(100), torch.zeros(104))
    assert runtime.launches == 1  # one launch context per call (two kernels inside)
