"""The host cost of one ``CupyKernels`` call, measured without a GPU (issue #23.1).

    python -m experiments.kernels.host_cost [--numel 1048576] [--calls 2000]

``CupyKernels`` runs on a *null runtime*: numpy as the array module (tensors still cross
through DLPack, as with CuPy) and kernels that return at once. What is timed is therefore the
wrapper's own work per call — argument checks, DLPack views, temporaries, grid sizes, the
launch context, one Python call per launch — the part that no GPU can make faster. CuPy's
own per-launch costs (``cupy.cuda.Device``, ``ExternalStream``, its DLPack import, the driver's
launch) come on top on a real GPU and are not in this figure. Prints µs per call, median of 5
batches.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from commopt.compressed import padded_size
from commopt.kernels.cupy_kernels import CupyKernels


class _NullLaunch:
    def kernel(self, source: str, name: str) -> Any:
        del source, name
        return lambda grid, block, args: None


class NullRuntime:
    """A :class:`~commopt.kernels.cupy_kernels.KernelRuntime` whose kernels do nothing."""

    device_type = "cpu"
    xp = np
    launches = 0

    @contextlib.contextmanager
    def launch(self, tensor: torch.Tensor) -> Iterator[_NullLaunch]:
        del tensor
        self.launches += 1
        yield _NullLaunch()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    n, padded = args.world_size, padded_size(args.numel, args.world_size)
    k = CupyKernels(NullRuntime())
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
    print(f"host cost per call, µs (null runtime, {args.numel:,} elements, n = {n}):")
    for name, call in calls.items():
        batches = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(args.calls // 5):
                call()
            batches.append((time.perf_counter() - t) / (args.calls // 5))
        print(f"  {name:<18} {1e6 * statistics.median(batches):7.1f}")


if __name__ == "__main__":
    main()
