"""experiments.optim.profile_step times the phases of a step by wrapping the functions that do
them; a refactor that renames one of them must fail here, not when someone runs the profile."""

from __future__ import annotations

import commopt.optim.onebit_adam as onebit_adam
from experiments.optim import profile_step


def test_every_phase_it_times_still_exists_and_is_unwrapped_after() -> None:
    original = onebit_adam.guarded_adam_update_
    with profile_step._instrumented():  # an AttributeError if a wrapped name is gone
        assert onebit_adam.guarded_adam_update_ is not original
    assert onebit_adam.guarded_adam_update_ is original
