"""griffe extension for the API reference: the docstrings as a reader of the site needs them.

The docstrings are written for ``help()`` and the source (Sphinx roles, ``.. math::`` blocks, a
``{schedule_and_resume}`` template filled in at import time, defaults named by constants);
mkdocstrings reads them statically. Before they are rendered, this rewrites

- ``:class:`~commopt.x.Y``` (any role) into a link to that object when it is in the site, the
  name as code otherwise (``~``: the last component only; ``.x`` is relative to the package);
- a ``.. math::`` block into a ``$$`` block, which arithmatex and MathJax typeset;
- ``{schedule_and_resume}`` and ``{communication_options}`` into the text
  ``commopt.optim.config.configured_by`` puts there;
- a default that names a constant (``DEFAULT_FREEZE_STEP``) into its value (``100000``).

``docs/hooks.py`` fails the build on anything of the kind left in a reference page.
"""

from __future__ import annotations

import importlib
import re
import textwrap
from typing import Any

import griffe

from commopt.optim.config import COMM_OPTIONS_DOC, SCHEDULE_AND_RESUME_DOC, fill_template

_ROLE = re.compile(
    r":(?:class|meth|func|mod|attr|data|exc|obj|ref):`(~?)([^`<]*?)(?:\s*<([^>]+)>)?`"
)
_MATH = re.compile(
    r"^(?P<indent>[ \t]*)\.\. math::[ \t]*\n(?P<body>(?:(?:(?P=indent)[ \t]+.*)?\n)+)", re.M
)
_CONSTANT = re.compile(r"^[A-Z][A-Z0-9_]*$")


def _templates() -> dict[str, str]:

    return {
        "{schedule_and_resume}": SCHEDULE_AND_RESUME_DOC,
        "{communication_options}": COMM_OPTIONS_DOC,
    }


def _roles(text: str, module: str) -> str:
    package = module.rsplit(".", 1)[0]

    def link(match: re.Match[str]) -> str:
        short, title, target = match.group(1), match.group(2).strip(), match.group(3)
        target = (target or title).strip()
        if target.startswith("."):
            target = f"{package}.{target.lstrip('.')}"
            title = title.lstrip(".")
        shown = target.rsplit(".", 1)[-1] if short else title
        if not target.startswith("commopt"):
            return f"`{shown}`"
        return f'<autoref identifier="{target}" optional><code>{shown}</code></autoref>'

    return _ROLE.sub(link, text)


def _math(text: str) -> str:
    def block(match: re.Match[str]) -> str:
        indent = match.group("indent")
        body = textwrap.dedent(match.group("body")).strip("\n")
        lines = [f"{indent}$$", *(f"{indent}{line}" for line in body.splitlines()), f"{indent}$$"]
        return "\n".join(lines) + "\n\n"

    return _MATH.sub(block, text)


def _constant_value(module: str, name: str) -> str | None:
    try:
        value = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return repr(value) if isinstance(value, (int, float, str)) else None


class CommoptDocstrings(griffe.Extension):
    """Rewrites every docstring and constant default of the loaded package (see the module)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        templates = _templates()
        seen: set[int] = set()
        stack: list[Any] = [pkg]
        while stack:
            obj = stack.pop()
            if obj.is_alias or id(obj) in seen:
                continue
            seen.add(id(obj))
            module = obj.module.path
            if obj.docstring is not None:
                text = obj.docstring.value
                for placeholder, value in templates.items():
                    text = fill_template(text, placeholder, value)
                obj.docstring.value = _math(_roles(text, module))
            if obj.is_function:
                for parameter in obj.parameters:
                    default = str(parameter.default) if parameter.default is not None else ""
                    if _CONSTANT.match(default):
                        value = _constant_value(module, default)
                        if value is not None:
                            parameter.default = value
            stack.extend(obj.members.values())
