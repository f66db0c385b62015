"""mkdocs hook: the experiment figures that docs/experiments.md shows live next to the
experiments that make them (experiments/**/results/**/*.png), outside docs/; copy them into the
site at the same relative place so the page's ``../experiments/...`` links resolve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
