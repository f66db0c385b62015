"""commopt: communication-compressed, error-compensated optimizers for slow networks.

1-bit Adam, 1-bit LAMB and 0/1 Adam as drop-in ``torch.optim`` optimizers that own their
gradient communication, on torch.distributed (NCCL/gloo) or MPI; and DiLoCo, an outer loop
whose rare pseudo-gradient average travels through the same 1-bit exchange.
"""

import importlib
from typing import Any

from commopt import ddp, fsdp
from commopt._version import __version__ as __version__
from commopt.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from commopt.comm import Backend, MixedBackend, MpiBackend, SingleProcessBackend, TorchBackend
from commopt.compressed import NonFiniteError, compressed_allreduce, padded_size
from commopt.deepspeed_compat import from_deepspeed_config, to_deepspeed_config
from commopt.diloco import DiLoCo
from commopt.faults import CollectiveError, watch
from commopt.launch import (
    broadcast_parameters,
    destroy_process_group,
    discover_launch,
    init,
    shutdown,
)
from commopt.monitor import log_comm_stats
from commopt.optim import OnebitAdam, OnebitLamb, ZeroOneAdam
from commopt.optim.freeze import AutoFreezeSettings

__all__ = [
    "AutoFreezeSettings",
    "Backend",
    "CheckpointError",
    "CollectiveError",
    "DiLoCo",
    "MixedBackend",
    "MpiBackend",
    "NonFiniteError",
    "OnebitAdam",
    "OnebitLamb",
    "SingleProcessBackend",
    "TorchBackend",
    "ZeroOneAdam",
    "broadcast_parameters",
    "compressed_allreduce",
    "ddp",
    "destroy_process_group",
    "discover_launch",
    "from_deepspeed_config",
    "fsdp",
    "init",
    "load_checkpoint",
    "log_comm_stats",
    "padded_size",
    "save_checkpoint",
    "shutdown",
    "to_deepspeed_config",
    "watch",
]


def __getattr__(name: str) -> Any:
    """``commopt.lightning`` and ``commopt.hf`` on first use: they import Lightning and
    transformers, which ``import commopt`` must not (most users do not have them); a clear
    ImportError when the framework is missing."""
    needs = {
        "lightning": ("lightning", "Lightning 2.4 or newer (lightning.pytorch)", "lightning"),
        "hf": ("transformers", "transformers", "hf"),
    }
    if name in needs:
        package, what, extra = needs[name]
        try:
            return importlib.import_module(f"commopt.{name}")
        except ModuleNotFoundError as err:
            if (err.name or "").split(".")[0] != package:
                raise
            raise ImportError(
                f"commopt.{name} needs {what}: pip install 'commopt[{extra}]'"
            ) from err
    raise AttributeError(f"module 'commopt' has no attribute {name!r}")
