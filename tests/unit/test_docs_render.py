"""The API reference renders docstring markup (issue #38.9): roles, math, templates, defaults.

``mkdocs build --strict`` (in scripts/test.sh) fails on any leftover in a reference page
(docs/hooks.py); these tests pin the rewriting itself (docs/griffe_commopt.py).
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

pytest.importorskip("griffe", reason="the docs extra renders the API reference")
_PATH = pathlib.Path(__file__).resolve().parents[2] / "docs" / "griffe_commopt.py"
_spec = importlib.util.spec_from_file_location("griffe_commopt", _PATH)
assert _spec is not None and _spec.loader is not None
ext = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ext)


def test_roles_become_links_or_code():
    text = (
        "See :class:`~commopt.optim.freeze.AutoFreeze`, :mod:`.flat_state`, "
        ":meth:`ZeroOneAdam._sync <commopt.optim.zero_one_adam.ZeroOneAdam>` and "
        ":func:`torch.lerp`."
    )
    out = ext._roles(text, "commopt.optim.base")
    assert '<autoref identifier="commopt.optim.freeze.AutoFreeze" optional>' in out
    assert "<code>AutoFreeze</code>" in out
    assert 'identifier="commopt.optim.flat_state"' in out and "<code>flat_state</code>" in out
    assert "<code>ZeroOneAdam._sync</code>" in out
    assert "`torch.lerp`" in out and ":" + "func:" not in out


def test_math_blocks_become_display_math():
    text = "Warmup:\n\n    .. math::\n        a = b \\\\\n        c = d\n\n    After.\n"
    out = ext._math(text)
    assert ".. math::" not in out
    assert "    $$\n    a = b \\\\\n    c = d\n    $$" in out
    assert out.rstrip().endswith("After.")


def test_constant_defaults_and_templates_have_their_values():
    assert ext._constant_value("commopt.optim.config", "DEFAULT_FREEZE_STEP") == "100000"
    assert "{schedule_and_resume}" in ext._templates()
    assert ext._templates()["{schedule_and_resume}"].startswith("Schedule and resume")
