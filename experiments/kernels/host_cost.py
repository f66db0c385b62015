"""What does one ``CupyKernels`` call cost the host? Measured without a GPU.

    python -m experiments.kernels.host_cost [--numel 1048576] [--calls 2000]

``CupyKernels`` runs on its real runtime, :class:`~commopt.kernels.cupy_runtime.CupyRuntime`,
over a *null driver*: CPU tensors stand in for device memory and the compiled functions return
at once. What is timed is therefore everything commopt does per call — argument checks, grid
sizes, the launcher look-up per (device, stream), raw pointers, the workspace, the scale it
returns, the call into the function — the part that no GPU can make faster. What CuPy's
``Function.__call__`` and the driver's launch add on a real GPU (a few µs per launch) is not in
this figure. Prints µs per call, median of 5 batches, and how many launches each call makes.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import types
from typing import Any

import torch

from commopt.compressed import padded_size
from commopt.kernels.cupy_kernels import CupyKernels
from commopt.kernels.cupy_runtime import CupyRuntime


class NullDriver:
    """A :class:`~commopt.kernels.cupy_runtime.CupyDriver` whose launches do nothing."""

    device_type = "cpu"

    def __init__(self) -> None:
        self.launches = 0

    def function(self, source: str, name: str, index: int) -> Any:
        del source, name, index

        def launch(grid: tuple, block: tuple, args: tuple, shared_mem: int, stream: Any) -> None:
            self.launches += 1

        return launch

    def current_device(self) -> int:
        return 0

    def raw_stream(self, index: int) -> int:
        return 0

    def stream(self, handle: int, index: int) -> Any:
        return types.SimpleNamespace(ptr=handle)

    def device(self, index: int) -> Any:
        return contextlib.nullcontext()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    n, padded = args.world_size, padded_size(args.numel, args.world_size)
    driver = NullDriver()
    k = CupyKernels(CupyRuntime(driver))
    x, e = torch.randn(args.numel), torch.zeros(padded)
    f, s = torch.zeros(padded // n), torch.ones(1)
    bits = torch.zeros(padded // 8, dtype=torch.uint8)
    rows = torch.zeros(n, padded // n // 8, dtype=torch.uint8)
    scales, out = torch.ones(n), torch.empty(args.numel)
    server_bits = torch.zeros(padded // n // 8, dtype=torch.uint8)
    calls = {
        "scale": lambda: k.scale(x, e),
        "pack_compensated_": lambda: k.pack_compensated_(x, s, e, bits),
        "server_reduce_": lambda: k.server_reduce_(rows, scales, f, server_bits),
        "unpack_scaled_": lambda: k.unpack_scaled_(rows, scales, out),
    }
    print(f"host cost per call, µs (null driver, {args.numel:,} elements, n = {n}):")
    for name, call in calls.items():
        before = driver.launches
        call()
        launches = driver.launches - before
        batches = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(args.calls // 5):
                call()
            batches.append((time.perf_counter() - t) / (args.calls // 5))
        print(
            f"  {name:<18} {1e6 * statistics.median(batches):7.1f}   ({launches} launch"
            f"{'es' if launches > 1 else ''})"
        )


if __name__ == "__main__":
    main()
