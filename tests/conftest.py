# ruff: noqa: E402  (torch is imported after its CPU kernels are capped, below)
"""Session-wide warm-up, done once in the pytest process before any rank is forked.

The multi-rank tests fork gloo ranks from this process (``tests/multirank/harness.py``), and a
forked child inherits whatever the parent has already imported or compiled. Two one-time costs
would otherwise be paid again in every rank of every test, seconds each on a loaded machine:

- ``torch._dynamo``, which ``torch.optim.Optimizer`` imports lazily on its first use;
- the CPU kernels chosen by ``commopt.kernels.get_kernels`` (numba JIT, loaded from its cache
  or compiled), which load on the first compressed call.
"""

from __future__ import annotations

from experiments.cpu_isa import cap_at_avx2

# torch's CPU kernels capped at AVX2 before torch loads them, as the demo does: the demo-table
# test re-trains 1-bit rows whose figures depend on an ulp (experiments/cpu_isa.py).
cap_at_avx2()

import torch
import torch._dynamo  # imported for its side effect (see the module docstring)

from commopt.kernels import get_kernels


def _warm_cpu_kernels() -> None:
    kernels = get_kernels(torch.device("cpu"))
    x = torch.linspace(-1.0, 1.0, 13)
    worker_error = torch.zeros(16)
    c = torch.empty(16)
    s = kernels.compensate(x, worker_error, c)
    bits = torch.empty(2, dtype=torch.uint8)
    kernels.pack_worker_(c, s, worker_error, bits)
    server_error = torch.zeros(16)
    server_bits = torch.empty(2, dtype=torch.uint8)
    t = kernels.server_reduce_(bits.view(1, 2), s.reshape(1), server_error, server_bits)
    kernels.unpack_scaled_(server_bits.view(1, 2), t.reshape(1), torch.empty(13))


_warm_cpu_kernels()
