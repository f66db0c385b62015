"""0/1 Adam's two schedules (SPEC §4): variance steps that thin out in phase A, sync steps that
spread out in phase B. Both are functions of ``global_state`` alone, so every rank takes the
same decision at the same step with no message."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from commopt.optim.variance_bias import variance_updates

if TYPE_CHECKING:
    from commopt.optim.config import ZeroOneAdamConfig

__all__ = ["ZeroOneSchedule"]


class ZeroOneSchedule:
    """The schedule part of :class:`commopt.ZeroOneAdam` (a mixin: it reads the optimizer's
    ``global_state``, ``config`` and ``param_groups``)."""

    if TYPE_CHECKING:  # defined by ZeroOneAdam and CompressedOptimizer
        global_state: dict[str, Any]
        config: ZeroOneAdamConfig
        param_groups: list[dict[str, Any]]

        def frozen_after(self) -> float: ...

        def _step_size(self, group: dict[str, Any]) -> float: ...

    def _variance_updates(self) -> int:
        """Variance updates so far (all ranks alike, from the schedule state)."""
        gs = getattr(self, "global_state", {})
        if "var_interval" not in gs:  # (the constructor's groups, before the schedule exists)
            return 0
        return variance_updates(
            gs["var_interval"], gs["var_counter"], self.config.var_update_scaler
        )

    def _is_variance_step(self, step: int) -> bool:
        gs = self.global_state
        return step <= self.frozen_after() and step % gs["var_interval"] == 0

    def _is_sync_step(self, step: int) -> bool:
        gs = self.global_state
        return step > self.frozen_after() and step % gs["local_interval"] == 0

    def _communicates(self, step: int) -> bool:
        return step <= self.frozen_after() or self._is_sync_step(step)

    def _advance_variance(self) -> None:
        """After every variance step: every var_update_scaler of them, I_v doubles."""
        gs = self.global_state
        gs["var_counter"] += 1
        if gs["var_counter"] == self.config.var_update_scaler:
            gs["var_counter"] = 0
            gs["var_interval"] *= 2

    def _advance_local(self) -> None:
        """After every phase-B step: s += η; every local_step_scaler steps, I_l doubles."""
        gs = self.global_state
        lrs = list(gs["lrs"]) + [0.0] * (len(self.param_groups) - len(gs["lrs"]))
        gs["lrs"] = [s + self._step_size(g) for s, g in zip(lrs, self.param_groups, strict=True)]
        gs["local_counter"] += 1
        if gs["local_counter"] == self.config.local_step_scaler:
            gs["local_counter"] = 0
            gs["local_interval"] = min(self.config.local_step_clipper, 2 * gs["local_interval"])
