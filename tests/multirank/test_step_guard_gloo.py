"""The default step guard (``"tiny"``) on 2 forked gloo ranks: replicas stay bit-identical while
it acts, and it acts only on the elements whose v is tiny next to their tensor's mean."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.multirank.harness import run_ranks
from tests.optim_registry import BY_NAME

TIMEOUT = 300.0
STEPS = 30


FREEZE = 8  # the last full-precision step


def _run(backend, kind: str, guard) -> dict:
    warnings.simplefilter("ignore")
    rank = backend.rank
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 2))
    opt = BY_NAME[kind].make(
        model.parameters(), freeze=FREEZE, lr=0.01, step_guard=guard, backend=backend
    )
    for t in range(STEPS):
        gen = torch.Generator().manual_seed(100 * t + rank)
        x = torch.randn(16, 6, generator=gen)
        # input 5 is rare: almost never seen before the freeze, then often (tiny frozen v)
        x[:, 5] = 0.0 if t < FREEZE + 2 else 3.0 * x[:, 5]
        if t == 2:
            x[0, 5] = 1e-4
        opt.zero_grad()
        ((model(x) - x[:, :2].sin()) ** 2).mean().backward()
        opt.step()
    params = BY_NAME[kind].shared(opt, model.parameters(), FREEZE)  # what replicas share
    tiny = [s.tiny_variance(0.01) for s in opt.flat_states]
    return {"params": params, "tiny": [None if i is None else i.tolist() for i in tiny]}


@pytest.mark.parametrize("kind", list(BY_NAME))
def test_default_guard_acts_and_replicas_stay_bit_identical(kind):
    guarded = run_ranks(_run, 2, kind, "tiny", timeout=TIMEOUT)
    plain = run_ranks(_run, 2, kind, False, timeout=TIMEOUT)
    assert torch.equal(guarded[0]["params"], guarded[1]["params"])
    assert guarded[0]["tiny"] == guarded[1]["tiny"]
    assert any(t for t in guarded[0]["tiny"])  # the rare input's weights are tiny-variance
    assert torch.isfinite(guarded[0]["params"]).all()
    # the guard changed the run (elements it clamped), and nothing else went wrong
    assert not torch.equal(guarded[0]["params"], plain[0]["params"])
