r"""0/1 Adam's variance bias correction: v̂ = v/(1 − β2^k), k = the variance updates v has had.

0/1 Adam (SPEC §4, the paper's reference implementation, DeepSpeed) uses v as it is. v starts
at 0 and after k variance updates is (1 − β2^k) of its level, so a variance frozen early (T_v
of a few hundred steps at β2 = 0.999) is a few per cent of its level and every step is
1/√(1 − β2^k) too large for the rest of the run. commopt's ``ZeroOneAdam(bias_correction=True)``
divides v by 1 − β2^k instead, an intended difference (docs/algorithms/zero_one_adam.md).

k counts *variance updates*, not steps: variance steps thin out (I_v doubles after every
``var_update_scaler`` of them), so k is far below t. It is a function of the shared schedule
alone, hence identical on every rank with no message, and needs no state of its own:
I_v = 2^j after j·S variance steps (S = ``var_update_scaler``), so the updates so far are
j·S + ``var_counter``. A param group added later counts from the update count when it joined.
"""

from __future__ import annotations

import math

__all__ = ["momentum_step_size", "variance_bias_sqrt", "variance_steps_through", "variance_updates"]


def variance_updates(var_interval: int, var_counter: int, scaler: int) -> int:
    """Variance updates since step 1, from 0/1 Adam's schedule state: I_v doubled once per
    ``scaler`` updates, so it is 2^j after j·scaler of them, plus ``var_counter`` since."""
    j = var_interval.bit_length() - 1
    if var_interval != 1 << j:
        raise ValueError(f"var_interval must be a power of 2, got {var_interval}")
    return j * scaler + var_counter


def variance_steps_through(step: int, scaler: int) -> int:
    """Variance steps among steps 1..``step`` of phase A (``step`` ≤ T_v), replaying the
    schedule: t is one when t ≡ 0 (mod I_v), I_v doubling after every ``scaler`` of them."""
    interval, counter, count = 1, 0, 0
    t = interval
    while t <= step:  # only the variance steps themselves: t jumps by I_v
        count += 1
        counter += 1
        if counter == scaler:
            counter, interval = 0, 2 * interval
        t = (t // interval + 1) * interval  # the next multiple of the (new) interval
    return count


def variance_bias_sqrt(beta2: float, k: int, correct: bool) -> float:
    r"""b = √(1 − β2^k), so that √v̂ = √v / b; 1 without correction, and for k = 0 (no update
    yet: v is 0 there, the zero-variance mask keeps those elements still, nothing to scale)."""
    if not correct or k <= 0:
        return 1.0
    return math.sqrt(1.0 - beta2**k)


def momentum_step_size(lr: float, beta1: float, t: int, correct: bool) -> float:
    r"""η/(1 − β1^t): the step size that applies m̂ = m/(1 − β1^t) (m is updated every step, so
    t counts steps, from the group's first); η itself without correction."""
    if not correct or t <= 0:
        return lr
    return lr / (1.0 - beta1**t)
