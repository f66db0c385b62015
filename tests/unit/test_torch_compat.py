"""commopt runs on every torch from MIN_TORCH (2.4) on: every ``torch.distributed``,
``torch.cuda`` and foreach name the package touches exists in torch 2.4.0
(tests/data/torch_2_4_names.txt, read from that release's sources), and the range is stated
where users read it. The multi-rank half is tests/multirank/test_torch_compat_gloo.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from commopt.comm import torch_compat
from commopt.comm.torch_compat import MIN_TORCH, all_gather_flat, torch_version

ROOT = Path(__file__).resolve().parents[2]
NAMES = {
    line.strip()
    for line in (ROOT / "tests/data/torch_2_4_names.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
}
# Module aliases as the package imports them.
MODULES = {"torch.distributed": "torch.distributed", "torch.cuda": "torch.cuda", "torch": "torch"}


def _touched(source: str) -> set[str]:
    """``torch.distributed.X``, ``torch.cuda.X`` and ``torch._foreach_X`` as the source uses
    them, through any ``import … as`` alias or ``from … import``."""
    tree = ast.parse(source)
    alias: dict[str, str] = {}
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES:
                    alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.module in MODULES and node.module != "torch":
            used |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            for a in node.names:
                if a.name in ("distributed", "cuda"):
                    alias[a.asname or a.name] = f"torch.{a.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain, inner = [node.attr], node.value
        while isinstance(inner, ast.Attribute):
            chain.append(inner.attr)
            inner = inner.value
        if not isinstance(inner, ast.Name) or inner.id not in alias:
            continue
        full = ".".join([alias[inner.id], *reversed(chain)])
        for prefix in ("torch.distributed.", "torch.cuda."):
            if full.startswith(prefix):
                rest = full[len(prefix) :].split(".")[0]
                if rest not in ("algorithms", "elastic", "run", "launcher", "nn"):
                    used.add(prefix + rest)
        m = re.match(r"torch\.(_foreach_\w+)", full)
        if m:
            used.add("torch." + m.group(1))
    return used


def test_scanner_sees_aliases() -> None:
    src = (
        "import torch\nimport torch.distributed as dist\nfrom torch.distributed import Work\n"
        "dist.all_gather_single(a, b)\ntorch.cuda.current_stream()\ntorch._foreach_max(x)\n"
        "torch.distributed.barrier()\n"
    )
    assert _touched(src) == {
        "torch.distributed.all_gather_single",
        "torch.distributed.Work",
        "torch.cuda.current_stream",
        "torch._foreach_max",
        "torch.distributed.barrier",
    }


def test_every_torch_name_the_package_touches_exists_in_torch_2_4() -> None:
    used: dict[str, list[str]] = {}
    for path in sorted((ROOT / "commopt").rglob("*.py")):
        for name in _touched(path.read_text()):
            used.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert "torch.distributed.all_reduce" in used  # the scan found the package's collectives
    missing = {name: files for name, files in used.items() if name not in NAMES}
    assert not missing, (
        f"not in torch {'.'.join(map(str, MIN_TORCH))}: {missing}; look newer APIs up through "
        "commopt/comm/torch_compat.py with a fallback"
    )


def test_the_supported_range_is_stated_where_users_read_it() -> None:
    floor = ".".join(map(str, MIN_TORCH))
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"torch>={floor}"' in pyproject
    assert f"torch ≥ {floor}" in (ROOT / "README.md").read_text()
    assert torch_version() >= MIN_TORCH


@pytest.mark.parametrize(
    ("text", "expected"), [("2.11.0+cu130", (2, 11)), ("2.4.1", (2, 4)), ("2.13.0a0+git", (2, 13))]
)
def test_torch_version(text: str, expected: tuple[int, int]) -> None:
    assert torch_version(text) == expected


def test_all_gather_flat_without_newer_collectives_uses_the_list_form(monkeypatch) -> None:
    """On a world of one (gloo, in this process), with both flat variants hidden."""
    calls: list[str] = []
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.delattr(dist, "all_gather_into_tensor", raising=False)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")

    def listed(pieces, t, group=None, async_op=False):
        calls.append("list")
        for piece in pieces:
            piece.copy_(t)

    monkeypatch.setattr(dist, "all_gather", listed)
    out = torch.zeros(6)
    all_gather_flat(out, torch.tensor([1.0, 2.0, 3.0]), None)
    assert calls == ["list"]
    assert out.tolist() == [1.0, 2.0, 3.0, 1.0, 2.0, 3.0]
    assert torch_compat.all_gather_flat is all_gather_flat
