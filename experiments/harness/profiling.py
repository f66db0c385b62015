"""Reading a :mod:`cProfile` of commopt code by qualified function name.

The profilers in experiments/ time a phase of ``step()`` as the inclusive time of the function
that does it. cProfile names a function only by file, first line and bare name (two methods
``scale`` in one file look alike), so the qualified name is read from the source with
:mod:`ast`. Nothing is patched and no private name is imported: the profile only reads the
running code, and tests/unit/test_profiling.py fails when a name stops being defined or called.
"""

from __future__ import annotations

import ast
import cProfile
import functools
import pathlib
import pstats
from collections.abc import Iterable

import commopt

__all__ = ["defined_names", "inclusive_times"]

_PACKAGE = pathlib.Path(commopt.__file__).resolve().parent


@functools.cache
def _qualnames(filename: str) -> dict[int, str]:
    """First line of each function in a commopt source file (its first decorator's, as in its
    code object) → ``module.Qualified.name``."""
    path = pathlib.Path(filename).resolve()
    module = ".".join(path.relative_to(_PACKAGE.parent).with_suffix("").parts)
    out: dict[int, str] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                out[first] = f"{module}.{prefix}{child.name}"
                walk(child, f"{prefix}{child.name}.<locals>.")

    walk(ast.parse(path.read_text()), "")
    return out


def defined_names() -> set[str]:
    """Every function's qualified name in commopt's source (``commopt.mod.Class.method``)."""
    return {q for f in _PACKAGE.rglob("*.py") for q in _qualnames(str(f)).values()}


def inclusive_times(profile: cProfile.Profile, names: Iterable[str]) -> dict[str, float]:
    """Seconds of inclusive time of each of ``names`` in ``profile``: commopt functions by
    qualified name, builtins by cProfile's own name (``"<method 'dot' of ...>"``). A function
    never called is absent."""
    wanted = set(names)
    out: dict[str, float] = {}
    for (filename, line, func), (_, _, _, cumulative, _) in pstats.Stats(profile).stats.items():
        name = func
        if filename != "~" and pathlib.Path(filename).resolve().is_relative_to(_PACKAGE):
            name = _qualnames(filename).get(line, func)
        if name in wanted:
            out[name] = out.get(name, 0.0) + cumulative
    return out
