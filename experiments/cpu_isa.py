"""Cap torch's CPU kernels at AVX2, before torch loads them, so that figures reproduce.

ATen, MKL and oneDNN choose AVX2 or AVX-512 code by CPU, which round differently by an ulp, and
a few hundred training steps amplify an ulp into another trajectory: on this project's
AVX-512 machine the convergence suite's digits LAMB ended at validation loss 0.0404 uncapped and
0.0218 capped, the demo's OnebitAdam at 2.1137 instead of 2.1124. Capped, a run is a function
of the code and its settings on any x86-64 CPU with AVX2. Variables already set are kept.
Imports nothing: use it before anything imports torch (the demo script,
experiments/demo/train_bytelm.py, calls it first thing).
"""

from __future__ import annotations

import os

__all__ = ["cap_at_avx2"]

CAPS = (
    ("ATEN_CPU_CAPABILITY", "avx2"),
    ("MKL_ENABLE_INSTRUCTIONS", "AVX2"),
    ("ONEDNN_MAX_CPU_ISA", "AVX2"),
)


def cap_at_avx2() -> None:
    """Set each of :data:`CAPS` in the environment unless it is set already."""
    for name, value in CAPS:
        os.environ.setdefault(name, value)
