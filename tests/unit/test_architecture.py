"""The package's shape: no import circle (``TYPE_CHECKING`` and imports inside functions
included), no module over 600 lines, no module that reads another object's private members
(issue 24); and the optimizer's spine (issue 39): optim/ in at most 16 modules, a base with no
mixin and no attribute hooks, subclasses that call none of its protected helpers, and no
function that takes the optimizer except the integration points. Read from the source with
``ast`` (the base's class is imported once, to read its bases; the optimizers come from the
registry)."""

from __future__ import annotations

import ast
import pathlib

import pytest

from tests.optim_registry import BY_NAME, OPTIMIZERS

ROOT = pathlib.Path(__file__).resolve().parents[2] / "commopt"

#: the longest modules (an optimizer with its paper's docstring, the base class, the early
#: work) stay under it with room: split by idea, not by a count
MAX_LINES = 600
#: optim/ with early/, __init__ files included (one module per idea)
MAX_OPTIM_MODULES = 16

#: private attributes of other libraries' objects that commopt reads on purpose
FOREIGN_PRIVATES = {
    "_version",  # torch's in-place version counter of a tensor
    "_getframe",  # sys
    "_exit",  # os
    "_use_count",  # torch tensor
    "_cdata",  # torch storage
    "_execution_engine",  # torch.autograd.Variable
    "_current_graph_task_id",  # torch._C: whether a backward pass runs (commopt.join)
    "_join_config",  # torch's Joinable protocol: Join sets it on each joinable
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
    """Imports of a private commopt module or name (``commopt.optim._layout``, ``_agree``)."""
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
    read private functions' times from a cProfile by name instead
    (experiments.harness.profiling)."""
    repo = ROOT.parent
    paths = [p for d in ("experiments", "examples") for p in (repo / d).rglob("*.py")]
    found = [hit for path in paths for hit in _private_imports(path)]
    reads = [hit for path in paths for hit in _private_reads(path)]
    found += [hit for hit in reads if hit.split(": ", 1)[1] not in NOT_COMMOPTS]
    assert found == []


def test_the_private_import_checker_finds_them(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(
        "import commopt.optim._layout\nfrom commopt.compressed import _agree, compression_bytes\n"
        "from commopt import OnebitAdam\nimport torch._C\n"
    )
    assert _private_imports(path) == [
        "m.py:1: import commopt.optim._layout",
        "m.py:2: from commopt.compressed import _agree, compression_bytes",
    ]


def test_optim_has_at_most_16_modules() -> None:
    modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "optim").rglob("*.py"))
    assert len(modules) <= MAX_OPTIM_MODULES, modules


def test_the_base_has_no_mixin_and_no_attribute_hooks() -> None:
    import torch

    from commopt.optim.base import CompressedOptimizer

    assert CompressedOptimizer.__bases__ == (torch.optim.Optimizer,)
    for cls in (info.cls for info in OPTIMIZERS):
        mine = [k for k in cls.__mro__ if k.__module__.startswith("commopt")]
        assert [k for k in mine if "__getattr__" in vars(k) or "__setattr__" in vars(k)] == []


#: what a subclass defines for the base to call (the hooks) or to read (the class knobs)
HOOKS = {"_step", "_early_plan", "_communicates", "_skip_local"}


def _base_privates() -> set[str]:
    """The protected names the base class defines: its methods and its ``self._x``."""
    tree = ast.parse((ROOT / "optim" / "base.py").read_text())
    (base,) = [
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CompressedOptimizer"
    ]
    names = {n.name for n in base.body if isinstance(n, ast.FunctionDef)}
    for node in ast.walk(base):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "self":
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")} - HOOKS


def _uses_of(path: pathlib.Path, names: set[str]) -> list[str]:
    """``self._x`` in a subclass's module for a protected ``_x`` of the base, unless the module
    defines ``_x`` itself (a method or an attribute it assigns)."""
    tree = ast.parse(path.read_text())
    own = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    own |= {
        t.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"
    }
    own |= {
        t.id
        for c in ast.walk(tree)
        if isinstance(c, ast.ClassDef)
        for n in c.body
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Name)
    }
    return [
        f"{path.name}:{n.lineno}: self.{n.attr}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and ast.unparse(n.value) == "self"
        and n.attr in names
        and n.attr not in own
    ]


@pytest.mark.parametrize("module", [info.cls.__module__.split(".")[-1] for info in OPTIMIZERS])
def test_no_subclass_calls_a_protected_helper_of_the_base(module: str) -> None:
    privates = _base_privates()
    assert {"_comm", "_layout", "_freeze", "_early"} <= privates  # (the checker sees them)
    assert _uses_of(ROOT / "optim" / f"{module}.py", privates) == []


def test_the_helper_checker_finds_one(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(
        "class A:\n    def f(self):\n        self._comm.x(); self._own = 1; self._own\n"
    )
    assert _uses_of(path, {"_comm", "_own"}) == ["m.py:3: self._comm"]


#: the public integration points, which take a user's optimizer by design (the issue's list,
#: plus the HF Trainer's callback, the DeepSpeed config export and the monitor, whose hook
#: has torch's signature, and torch's Join protocol, whose hook steps the optimizer)
TAKES_THE_OPTIMIZER = {
    "ddp.py",
    "join.py",
    "fsdp.py",
    "lightning.py",
    "hf.py",
    "checkpoint",
    "deepspeed_compat.py",
    "monitor.py",
}
_OPTIMIZERS = {"CompressedOptimizer", "DiLoCo", *BY_NAME}


def _takes_the_optimizer(path: pathlib.Path) -> list[str]:
    """Functions with a parameter named ``opt``/``optimizer`` or annotated as one of commopt's
    optimizers (DiLoCo's constructor takes the user's *inner* optimizer, which it wraps)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for arg in node.args.args + node.args.kwonlyargs + node.args.posonlyargs:
            note = ast.unparse(arg.annotation) if arg.annotation is not None else ""
            if arg.arg in ("opt", "optimizer") or note.split(".")[-1] in _OPTIMIZERS:
                found.append(f"{path.name}:{node.lineno}: {node.name}({arg.arg})")
    return found


def test_no_function_takes_the_optimizer_except_the_integration_points() -> None:
    paths = [
        p
        for p in ROOT.rglob("*.py")
        if p.name not in TAKES_THE_OPTIMIZER
        and p.relative_to(ROOT).parts[0] not in TAKES_THE_OPTIMIZER
    ]
    found = [hit for path in paths for hit in _takes_the_optimizer(path)]
    assert found == []


def test_the_optimizer_argument_checker_finds_one(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.py"
    path.write_text("def f(x, o: CompressedOptimizer): ...\ndef g(opt): ...\ndef h(self): ...\n")
    assert _takes_the_optimizer(path) == ["m.py:1: f(o)", "m.py:2: g(opt)"]


def _experiments_importing(prefix: str) -> list[str]:
    """``file:line`` of every import in experiments/ of a module under ``prefix``."""
    repo = ROOT.parent
    found = []
    for path in sorted((repo / "experiments").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            found += [
                f"{path.name}:{node.lineno}"
                for n in names
                if n == prefix or n.startswith(prefix + ".")
            ]
    return found


def test_experiments_import_nothing_from_tests() -> None:
    """The experiments' harness (experiments/harness/) owns the rank launcher and the small
    tasks; tests may import it, not the reverse."""
    assert _experiments_importing("tests") == []


def test_no_experiment_imports_the_demo_script() -> None:
    """The demo is a script (its rows and its table); its task and its training run are the
    harness's (experiments.harness.bytelm), which the other studies of the byte LM import."""
    assert _experiments_importing("experiments.demo") == []
