"""Optimizer state on a CUDA device: created there, kept there, and the same steps as on CPU.

Runs only where a CUDA GPU is visible; elsewhere skipped with the reason (no CPU stand-in can
allocate CUDA tensors; tests/gpu/test_gpu_paths_with_fakes.py covers the stream and staging
logic without one). One process, so the exchange is the world-of-one identity: this checks
where the state lives and the Adam/LAMB math on the device, not the compressed exchange
(that needs two GPUs: see tests/gpu/README.md).
"""

from __future__ import annotations

import functools

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible to torch", allow_module_level=True)

from commopt.comm import SingleProcessBackend
from tests.optim_registry import OPTIMIZERS


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_state_stays_on_the_device_and_steps_match_cpu(info):
    make = functools.partial(info.make, backend=SingleProcessBackend())  # one process
    gen = torch.Generator().manual_seed(0)
    w_cpu = torch.nn.Parameter(torch.randn(4099, generator=gen))
    w_gpu = torch.nn.Parameter(w_cpu.detach().to("cuda"))
    opt_cpu, opt_gpu = make([w_cpu]), make([w_gpu])
    for _ in range(8):  # past freeze_step / var_freeze_step: both phases
        g = torch.randn(4099, generator=gen)
        w_cpu.grad, w_gpu.grad = g.clone(), g.to("cuda")
        opt_cpu.step()
        opt_gpu.step()
    for key, value in opt_gpu.state[w_gpu].items():
        if isinstance(value, torch.Tensor) and value.numel() > 1:
            assert value.device == w_gpu.device, f"state[{key!r}] is on {value.device}"
    # CUDA's sqrt/div are IEEE, but torch may fuse or reorder element-wise ops on the device.
    torch.testing.assert_close(w_gpu.detach().cpu(), w_cpu.detach(), rtol=1e-5, atol=1e-6)
    restored = make([torch.nn.Parameter(w_gpu.detach().clone())])
    restored.load_state_dict(opt_gpu.state_dict())
    for value in next(iter(restored.state.values())).values():
        if isinstance(value, torch.Tensor) and value.numel() > 1:
            assert value.device.type == "cuda", "state_dict round trip moved state off the device"
