r"""DiLoCo: communicate rarely, then at one bit.

:class:`DiLoCo` wraps any inner optimizer: H local steps, then the pseudo-gradient (the
weights at the last sync minus the weights now) is averaged across the workers and an outer
SGD step moves the shared anchor. The average is fp32, bf16, or SPEC §1's error-compensated
1-bit exchange with its errors kept from sync to sync (docs/algorithms/diloco.md).

The package: :mod:`~commopt.diloco.outer` (the loop), :mod:`~commopt.diloco.schedule` (where
it stands, and the schedule's defaults), :mod:`~commopt.diloco.averages` (the three
averages), :mod:`~commopt.diloco.fragments` (streaming: the parameters in fragments with
staggered syncs), :mod:`~commopt.diloco.agreement` (the ranks agree on the settings and the
step), :mod:`~commopt.diloco.checkpointing` (the state dict).
"""

from commopt.choices import COMPRESSIONS
from commopt.diloco.outer import DiLoCo
from commopt.diloco.schedule import FP32_START, OUTER_DEFAULTS, Progress, default_fp32_syncs

__all__ = [
    "COMPRESSIONS",
    "FP32_START",
    "OUTER_DEFAULTS",
    "DiLoCo",
    "Progress",
    "default_fp32_syncs",
]
