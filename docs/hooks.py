"""mkdocs hooks: the experiment figures that docs/experiments.md shows live next to the
experiments that make them (experiments/**/results/**/*.png), outside docs/; copy them into the
site at the same relative place so the page's ``../experiments/...`` links resolve. And no raw
docstring markup in the API reference (``on_post_page``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]


def on_files(files: Files, config: Any) -> Files:
    for png in sorted((ROOT / "experiments").glob("**/results/**/*.png")):
        rel = png.relative_to(ROOT).as_posix()
        files.append(File.generated(config, f"experiments-figures/{rel}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    # On GitHub the pages link ../experiments/...; in the site that folder is experiments-figures/.
    if page.file.src_uri == "experiments.md":
        return markdown.replace("](../experiments/", "](experiments-figures/experiments/")
    return markdown


# A reference page must not show markup meant for the source: a template placeholder
# ({schedule_and_resume}), a reST directive (.. math::), a Sphinx role (:class:`…`) or a default
# named by a constant (docs/griffe_commopt.py rewrites all four; this catches a new one).
_LEFTOVER = re.compile(
    r"\{[a-z_]+\}|\.\. [a-z]+::|:(?:class|meth|func|mod|attr|data|exc|obj|ref):"
    r"|\bDEFAULT_[A-Z_]+\b"
)
_CODE = re.compile(r"<(pre|code)\b.*?</\1>|<(div|span) class=\"arithmatex\">.*?</\2>", re.DOTALL)


def on_post_page(output: str, page: Any, config: Any) -> str:
    if page.file.src_uri.startswith("reference/"):
        text = _CODE.sub("", output)
        found = sorted({m.group(0) for m in _LEFTOVER.finditer(text)})
        if found:
            raise PluginError(
                f"{page.file.src_uri}: raw docstring markup in the API reference: {found} "
                "(docs/griffe_commopt.py renders roles, math, templates and constant defaults)"
            )
    return output
