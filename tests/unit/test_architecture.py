"""The package's shape, as issue 24 set it: no import circle (``TYPE_CHECKING`` and imports inside
functions included), no module over 400 lines, and no module that reads another object's
private members. Read from the source with ``ast``: nothing is imported."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "commopt"

#: the longest modules (an optimizer with its paper's docstring, the base class, the early
#: work) are just under it
MAX_LINES = 400

#: private attributes of other libraries' objects that commopt reads on purpose
FOREIGN_PRIVATES = {
    "_version",  # torch's in-place version counter of a tensor
    "_getframe",  # sys
    "_exit",  # os
    "_use_count",  # torch tensor
    "_cdata",  # torch storage
    "_execution_engine",  # torch.autograd.Variable
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                full = f"{mod}.{alias.name}"
                deps.add(full if full in modules else mod)
        elif isinstance(node, ast.Import):
            deps.update(alias.name for alias in node.names)
    return {d for d in deps if d in modules and d != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_anywhere() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == []


def test_the_checker_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("name", sorted(_modules()))
def test_module_is_short(name: str) -> None:
    lines = len(_modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines"


def _private_reads(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        attr, value = node.attr, node.value
        if not attr.startswith("_") or attr.startswith("__") or attr in FOREIGN_PRIVATES:
            continue
        if attr.startswith("_foreach"):  # torch's foreach kernels
            continue
        if isinstance(value, ast.Name) and value.id in ("self", "cls", "torch"):
            continue
        if isinstance(value, ast.Call) and ast.unparse(value.func) == "super":
            continue
        found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reads_another_objects_private_members() -> None:
    found = [hit for path in _modules().values() for hit in _private_reads(path)]
    assert found == []


def test_the_private_read_checker_finds_one(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.py"
    path.write_text("def f(opt):\n    return opt._early_kind, self._fine, torch._foreach_mul_\n")
    assert _private_reads(path) == ["m.py:2: opt._early_kind"]


#: private attributes read in experiments/ and examples/ that are not commopt's
NOT_COMMOPTS = {
    "DDP._set_params_and_buffers_to_ignore_for_model",  # torch's way to keep a layer out of DDP
    "model._commopt",  # the HF example's own marker: the hook is registered once
}


def _private_imports(path: pathlib.Path) -> list[str]:
    """Imports of a private commopt module or name (``commopt.optim._adam``, ``_agree``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("commopt"):
            names = [node.module or "", *(a.name for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("commopt")]
        else:
            continue
        parts = [p for name in names for p in name.split(".")]
        if any(p.startswith("_") and not p.startswith("__") for p in parts):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_experiments_and_examples_use_only_public_names() -> None:
    """They show how commopt is used (issue 24: no imports of private names); the profilers
    read private functions' times from a cProfile by name instead (experiments.common.profiling)."""
    repo = ROOT.parent
    paths = [p for d in ("experiments", "examples") for p in (repo / d).rglob("*.py")]
    found = [hit for path in paths for hit in _private_imports(path)]
    reads = [hit for path in paths for hit in _private_reads(path)]
    found += [hit for hit in reads if hit.split(": ", 1)[1] not in NOT_COMMOPTS]
    assert found == []


def test_the_private_import_checker_finds_them(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(
        "import commopt.optim._adam\nfrom commopt.compressed import _agree, compression_bytes\n"
        "from commopt import OnebitAdam\nimport torch._C\n"
    )
    assert _private_imports(path) == [
        "m.py:1: import commopt.optim._adam",
        "m.py:2: from commopt.compressed import _agree, compression_bytes",
    ]
