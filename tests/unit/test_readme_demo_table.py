"""The README quotes the demo's current table (experiments/demo/results/table.md), verbatim."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BEGIN = "<!-- demo table: experiments/demo/results/table.md -->"
END = "<!-- end of demo table -->"


def test_readme_quotes_the_demo_table() -> None:
    readme = (ROOT / "README.md").read_text()
    assert BEGIN in readme and END in readme, "the README lost its demo-table markers"
    quoted = readme.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    table = (ROOT / "experiments" / "demo" / "results" / "table.md").read_text().strip()
    assert quoted == table, "README.md's demo table differs from experiments/demo/results/table.md"
