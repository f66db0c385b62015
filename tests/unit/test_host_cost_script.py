"""experiments/kernels/host_cost.py runs (a small size) through the real CupyRuntime on a null
driver, and each call makes the launches the issue asks for: one per norm kernel (finished in
its last block), two for the server step."""

from __future__ import annotations

import torch

from commopt.kernels.cupy_kernels import CupyKernels
from commopt.kernels.cupy_runtime import CupyRuntime
from experiments.kernels import host_cost


def test_host_cost_prints_each_call(capsys) -> None:
    host_cost.main(["--numel", "4096", "--calls", "10"])
    out = capsys.readouterr().out
    for name in ("scale", "pack_compensated_", "server_reduce_", "unpack_scaled_"):
        assert name in out


def test_one_launch_per_norm_and_a_cached_launcher_per_stream() -> None:
    driver = host_cost.NullDriver()
    runtime = CupyRuntime(driver)
    kernels = CupyKernels(runtime)
    x, e = torch.randn(100), torch.zeros(104)
    kernels.scale(x, e)
    assert driver.launches == 1  # no separate finishing kernel
    f, rows = torch.zeros(52), torch.zeros(2, 52 // 8, dtype=torch.uint8)
    kernels.server_reduce_(rows, torch.ones(2), f, torch.zeros(52 // 8, dtype=torch.uint8))
    assert driver.launches == 3  # average (t in its last block), then pack
    assert runtime.launcher(x) is runtime.launcher(e)  # one per (device, stream), reused
    first = runtime.launcher(x).workspace(10)
    assert runtime.launcher(x).workspace(4096) is first  # reused while large enough
    assert runtime.launcher(x).workspace(5000) is not first
