"""A script that forgets ``commopt.init()`` under torchrun fails on every rank, saying so,
instead of training each rank alone with exit code 0 (what it did before)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import commopt
from commopt.comm import SingleProcessBackend, resolve_backend
from tests.multirank.harness import free_port

SCRIPT = """
import torch, commopt
model = torch.nn.Linear(4, 2)
opt = commopt.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=2)
model(torch.randn(3, 4)).sum().backward()
opt.step()
print("trained alone")
"""


@pytest.mark.parametrize("value", ["2", " 2", "2 ", "+2", "02"])
def test_resolve_backend_refuses_a_lone_rank(monkeypatch, value) -> None:
    assert not dist.is_initialized()
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    commopt.comm.set_default_backend(None)
    monkeypatch.setenv("WORLD_SIZE", value)  # (issue 41: " 2" used to slip through)
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2 .* call commopt\.init\(\)"):
        resolve_backend()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert isinstance(resolve_backend(), SingleProcessBackend)


def test_a_world_size_that_is_no_integer_is_named(monkeypatch) -> None:
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    commopt.comm.set_default_backend(None)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE environment variable must be an integer"):
        resolve_backend()


def test_torchrun_without_init_fails_on_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "PMIX_"))}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_port", str(free_port()), str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "trained alone" not in out
    assert out.count("WORLD_SIZE=2 says this is one of 2 ranks") >= 2, out[-3000:]
