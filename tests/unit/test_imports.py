"""The package's import graph has no circles (issue #11.5).

Launch discovery lives in ``commopt.comm.env``, below both ``commopt.launch`` and
``commopt.comm``; nothing inside the package imports the package face ``commopt`` (whose
``__init__`` imports everything, so any such import is a circle waiting to happen).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import commopt
import commopt.comm
import commopt.comm.env
import commopt.launch

_PKG = pathlib.Path(commopt.__file__).parent


def _imports(path: pathlib.Path) -> list[str]:
    """Every module ``path`` imports, at any depth (function-local imports included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return found


@pytest.mark.parametrize(
    "path",
    [
        *sorted(p for sub in ("checkpoint", "comm", "kernels") for p in (_PKG / sub).glob("*.py")),
        *(_PKG / f"{name}.py" for name in ("faults", "launch", "monitor")),
    ],
    ids=lambda p: str(p.relative_to(_PKG)),
)
def test_no_module_imports_the_package_face_or_launch_from_below(path: pathlib.Path) -> None:
    mods = _imports(path)
    face = [m for m in mods if m == "commopt" or m.startswith("commopt.__")]
    assert not face, f"{path.name} imports the package face: {face}"
    if path.parent.name in ("comm", "kernels"):
        up = [
            m
            for m in mods
            if m.startswith("commopt.") and m.split(".")[1] not in ("comm", "kernels")
        ]
        assert not up, f"{path.relative_to(_PKG)} imports from above comm/kernels: {up}"


def test_launch_discovery_is_one_object_under_both_names() -> None:
    for name in ("LaunchInfo", "discover_launch", "launched_by_mpi"):
        assert getattr(commopt.launch, name) is getattr(commopt.comm.env, name)
    assert commopt.discover_launch is commopt.comm.env.discover_launch


@pytest.mark.parametrize("path", ["table.json", pathlib.Path("table.json"), b"table.json"])
def test_resolve_backend_refuses_a_path(path: object) -> None:
    with pytest.raises(TypeError, match=r"a path is not a backend.*MixedBackend\.from_table"):
        commopt.comm.resolve_backend(path)  # type: ignore[arg-type]


def test_mixed_backend_from_table_is_explicit() -> None:
    assert commopt.MixedBackend.from_table.__func__ is commopt.MixedBackend.from_available.__func__
    with pytest.raises(RuntimeError, match="no communication backend is available"):
        commopt.MixedBackend.from_table({"backends": ["torch"], "rules": []})


def test_the_documented_lightning_line_works_after_import_commopt_alone():
    # Issue #38.8: `commopt.lightning.OnebitHookCallback()` raised AttributeError unless the
    # user had imported the submodule first; and `import commopt` must not import Lightning.
    import subprocess
    import sys

    pytest.importorskip("lightning.pytorch", reason="needs the [lightning] extra")
    code = (
        "import sys, commopt\n"
        "assert 'lightning' not in sys.modules, 'import commopt imported Lightning'\n"
        "cb = commopt.lightning.OnebitHookCallback()\n"
        "print(type(cb).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "OnebitHookCallback"


def test_commopt_lightning_without_lightning_says_how_to_install(monkeypatch):
    import sys

    import commopt

    monkeypatch.delitem(sys.modules, "commopt.lightning", raising=False)
    if "lightning" in vars(commopt):  # set by an earlier import (test collection, say)
        # (not delattr(raising=False): its hasattr would import the submodule through
        # commopt.__getattr__, Lightning still present, when no earlier import had)
        monkeypatch.delattr(commopt, "lightning")
    monkeypatch.setitem(sys.modules, "lightning", None)  # "not installed"
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    with pytest.raises(ImportError, match=r"pip install 'commopt\[lightning\]'"):
        commopt.lightning  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'lightnin'"):
        commopt.lightnin  # noqa: B018


def test_commopt_hf_without_transformers_says_how_to_install(monkeypatch):
    import sys

    import commopt

    monkeypatch.delitem(sys.modules, "commopt.hf", raising=False)
    if "hf" in vars(commopt):  # (as above: not delattr(raising=False))
        monkeypatch.delattr(commopt, "hf")
    monkeypatch.setitem(sys.modules, "transformers", None)  # "not installed"
    with pytest.raises(ImportError, match=r"pip install 'commopt\[hf\]'"):
        commopt.hf  # noqa: B018
