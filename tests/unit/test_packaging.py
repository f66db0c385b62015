"""What a plain ``pip install`` brings (issue #11.1): the fast CPU kernels, without extras."""

from __future__ import annotations

import pathlib
import re

import tomllib

_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _project() -> dict:
    with open(_ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_numba_is_a_core_dependency() -> None:
    assert "numba" in _names(_project()["dependencies"])


def test_old_fast_extra_still_resolves() -> None:
    # `pip install 'commopt[fast]'` keeps working (an empty alias: numba is in the core now).
    extras = _project()["optional-dependencies"]
    assert "fast" in extras
    assert not _names(extras["fast"]) - {"numba"}


def test_mpi_and_cuda_extras_bring_their_libraries() -> None:
    extras = _project()["optional-dependencies"]
    assert "mpi4py" in _names(extras["mpi"])
    assert any(n.startswith("cupy") for n in _names(extras["cuda"]))


def test_version_is_one_and_has_a_changelog_section() -> None:
    import commopt

    assert _project()["version"] == commopt.__version__
    changelog = (_ROOT / "CHANGELOG.md").read_text()
    assert f"## [{commopt.__version__}] - " in changelog
