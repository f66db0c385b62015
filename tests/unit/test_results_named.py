"""Every result file kept in the tree is one that the README, docs/ or experiments/README.md
names (issue 39: "only the result files that the README or docs name stay in the tree; git keeps
the rest"). A name counts as the docs write them: a path or a bare file name, with shell braces
(``1gbit-pipelined{,-2,-3}.md``) and globs (``1gbit-2026-11-24-*.md``) expanded, a directory
(``experiments/tcp/results/overlap/``) naming the files directly in it, and a table's ``.md``
naming its ``.json`` twin (the raw figures the benchmark wrote with it)."""

from __future__ import annotations

import fnmatch
import pathlib
import re
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[2]
_TOKEN = re.compile(r"[\w./{},*\-]*[\w*}/]")


def _expand(text: str) -> list[str]:
    """Shell brace expansion of ``text`` (nested braces included)."""
    m = re.search(r"\{([^{}]*)\}", text)
    if m is None:
        return [text]
    out = []
    for alt in m[1].split(","):
        out += _expand(text[: m.start()] + alt + text[m.end() :])
    return out


def _names() -> set[str]:
    docs = [REPO / "README.md", REPO / "experiments" / "README.md", *(REPO / "docs").rglob("*.md")]
    names = set()
    for doc in docs:
        for token in _TOKEN.findall(doc.read_text()):
            # a file (a dot in it) or a directory, not markdown's ``*`` / ``**`` emphasis
            if not token.startswith("*") and ("." in token or token.endswith("/")):
                names.update(_expand(token))
    return names


def _named(path: str, names: set[str]) -> bool:
    base = path.rsplit("/", 1)[-1]
    for name in names:
        if name.endswith("/"):
            if path.startswith(name) and "/" not in path[len(name) :]:
                return True
        elif "/" in name:
            if fnmatch.fnmatchcase(path, name) or fnmatch.fnmatchcase(path, "*/" + name):
                return True
        elif fnmatch.fnmatchcase(base, name):
            return True
    return False


def test_every_result_file_is_named_by_the_docs() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "experiments"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    results = [f for f in tracked if "/results/" in f]
    assert results, "no result files found: is this a git checkout?"
    names = _names()
    unnamed = [
        f
        for f in results
        if not _named(f, names)
        and not (f.endswith(".json") and _named(f[: -len(".json")] + ".md", names))
    ]
    assert not unnamed, (
        "result files no document names (cite them where their figures are used, or delete "
        "them: git keeps them):\n" + "\n".join(unnamed)
    )


def test_the_check_sees_an_unnamed_file() -> None:
    names = {"experiments/tcp/results/1gbit-pipelined.*", *_expand("1gbit-cpucost-{1,2}.md"), "x/"}
    assert _named("experiments/tcp/results/1gbit-cpucost-1.md", names)
    assert _named("experiments/tcp/results/1gbit-pipelined.json", names)
    assert _named("a/b/1gbit-cpucost-2.md", names)
    assert _named("x/table.md", names)
    assert not _named("x/deeper/table.md", names)
    assert not _named("experiments/tcp/results/1gbit-rerun-7.md", names)
    assert not _named("a/b/1gbit-cpucost-3.md", names)
