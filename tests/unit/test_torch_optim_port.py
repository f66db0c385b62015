"""torch's ``TestOptimRenewed``, ported (``tests/torch_optim_port.py``), in one process: every
body on ``torch.optim.Adam`` (the control) and on each commopt optimizer, with the registry's
short schedule and with the library defaults."""

from __future__ import annotations

import pytest

from tests.torch_optim_port import ENTRIES, cases, run

_CASES = cases()


@pytest.mark.parametrize("entry", [e.name for e in ENTRIES])
@pytest.mark.parametrize(
    ("body", "kwargs"),
    _CASES,
    ids=[name + "".join(f"-{k}={v}" for k, v in kw.items()) for name, kw in _CASES],
)
def test_ported(body, kwargs, entry):
    run(body, entry, **kwargs)
