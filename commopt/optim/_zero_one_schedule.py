"""0/1 Adam's two schedules (SPEC §4): variance steps that thin out in phase A, sync steps that
spread out in phase B. Both are functions of the shared schedule state alone (kept in the
optimizer's ``global_state``, saved with it), so every rank takes the same decision at the same
step with no message."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from commopt.optim._adam import variance_updates

if TYPE_CHECKING:
    from commopt.optim.config import ZeroOneAdamConfig

__all__ = ["ZeroOneSchedule"]


class ZeroOneSchedule:
    """I_v and I_l over the state they live in (``state``: the optimizer's ``global_state``;
    ``frozen_after``: T_v, the last step of phase A, as it is now; ``config``: the scalers)."""

    #: the schedule's keys in ``global_state`` and their values at step 0
    START: dict[str, Any] = {  # noqa: RUF012 - read-only, copied by start()
        "var_interval": 1,  # I_v: variance steps are t ≡ 0 (mod I_v)
        "var_counter": 0,  # variance steps since I_v last doubled
        "local_interval": 1,  # I_l: sync steps are t ≡ 0 (mod I_l) in phase B
        "local_counter": 0,  # phase-B steps since I_l last doubled
        "local_started": False,  # phase B entered: errors zeroed, p_sync set
        "lrs": [],  # s, per param group: Σ η over the phase-B steps since the last sync
    }

    def __init__(
        self, state: dict[str, Any], frozen_after: Callable[[], float], config: ZeroOneAdamConfig
    ) -> None:
        self.state = state
        self._frozen_after = frozen_after
        self._var_scaler = config.var_update_scaler
        self._local_scaler = config.local_step_scaler
        self._clipper = config.local_step_clipper
        for key, value in self.START.items():
            state.setdefault(key, list(value) if isinstance(value, list) else value)

    def variance_updates(self) -> int:
        """Variance updates so far (all ranks alike, from the schedule state)."""
        return variance_updates(
            self.state["var_interval"], self.state["var_counter"], self._var_scaler
        )

    def is_variance_step(self, step: int) -> bool:
        """Phase A, t ≡ 0 (mod I_v): the gradient is averaged at full precision, v updated."""
        return step <= self._frozen_after() and step % self.state["var_interval"] == 0

    def is_sync_step(self, step: int) -> bool:
        """Phase B, t ≡ 0 (mod I_l): the replicas are synced."""
        return step > self._frozen_after() and step % self.state["local_interval"] == 0

    def communicates(self, step: int) -> bool:
        """Every phase-A step talks to the other ranks; in phase B only the syncs do."""
        return step <= self._frozen_after() or self.is_sync_step(step)

    def advance_variance(self) -> None:
        """After every variance step: every var_update_scaler of them, I_v doubles."""
        gs = self.state
        gs["var_counter"] += 1
        if gs["var_counter"] == self._var_scaler:
            gs["var_counter"] = 0
            gs["var_interval"] *= 2

    def advance_local(self, step_sizes: Sequence[float]) -> None:
        """After every phase-B step: s += η (``step_sizes``, per param group); every
        local_step_scaler steps, I_l doubles (up to local_step_clipper)."""
        gs = self.state
        lrs = list(gs["lrs"]) + [0.0] * (len(step_sizes) - len(gs["lrs"]))
        gs["lrs"] = [s + eta for s, eta in zip(lrs, step_sizes, strict=True)]
        gs["local_counter"] += 1
        if gs["local_counter"] == self._local_scaler:
            gs["local_counter"] = 0
            gs["local_interval"] = min(self._clipper, 2 * gs["local_interval"])
