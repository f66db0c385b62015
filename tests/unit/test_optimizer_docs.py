"""docs/optimizers.md opens with every constructor argument and its default, as the code has
them: a row per argument, in signature order, with the default's repr."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import commopt
from commopt.optim.config import CommKeywords, CommOptions
from tests.optim_registry import BY_NAME

DOC = (Path(__file__).resolve().parents[2] / "docs/optimizers.md").read_text()


@pytest.mark.parametrize("name", list(BY_NAME))
def test_every_argument_and_default_is_in_the_table(name: str) -> None:
    section = DOC.split(f"### `commopt.{name}`", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| `(.*?)` \|", section, re.M)
    expected = []
    for p in inspect.signature(getattr(commopt, name)).parameters.values():
        if p.kind is p.VAR_KEYWORD:  # **comm: CommOptions' fields, in their order
            expected += [(f.name, repr(f.default)) for f in dataclasses.fields(CommOptions)]
        elif p.name != "params":
            expected.append((p.name, repr(p.default)))
    assert rows == expected


def test_the_constructors_keywords_are_the_options_fields() -> None:
    """``**comm: Unpack[CommKeywords]`` types what CommOptions validates: the same names."""
    fields = [f.name for f in dataclasses.fields(CommOptions)]
    assert list(CommKeywords.__annotations__) == fields
