"""The convergence suite runs torch's CPU kernels at AVX2, whatever the CPU, so that its figures
reproduce (experiments/cpu_isa.py): uncapped, an AVX-512 machine moved digits' LAMB from 0.0218
to 0.0404."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from experiments.cpu_isa import CAPS

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _capability(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in dict(CAPS)}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("module", ["experiments.convergence.run", "experiments.convergence.seeds"])
def test_the_suite_caps_torch_at_avx2_before_it_loads(module):
    # The AVX2 kernels are chosen when the module is imported first, as `python -m` does.
    got = _capability(
        f"import {module}, os, torch; "
        "print(torch.backends.cpu.get_cpu_capability(), os.environ['ATEN_CPU_CAPABILITY'])"
    )
    assert got.split()[1] == "avx2"
    assert got.split()[0] != "AVX512"  # what torch picks uncapped on an AVX-512 CPU


def test_a_choice_already_made_is_kept():
    env_choice = "import os; os.environ['ATEN_CPU_CAPABILITY'] = 'default'; "
    got = _capability(
        env_choice + "import experiments.convergence.run, os; "
        "print(os.environ['ATEN_CPU_CAPABILITY'])"
    )
    assert got == "default"
