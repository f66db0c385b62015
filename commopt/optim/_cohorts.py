"""Parameters that start late: their first gradient arrives after their group's first step.

torch.optim creates a parameter's state at its first gradient and counts its steps from there,
so a layer frozen through the warmup and unfrozen later trains like a fresh one. commopt's
schedule is per bucket (the warmup, the variance freeze, bias correction): a parameter that got
no gradient on any rank through the whole warmup would have a variance of 0, frozen, and would
never move. So the ranks note, in the per-step agreement they already make, which parameters
have never had a gradient since their group began; when one gets its first gradient after a
step without, it *starts a cohort* at the step before: it moves to buckets of its own and runs
its own schedule from there, exactly as if it had been added with ``add_param_group`` then.

The bookkeeping lives in the optimizer's ``global_state`` (saved and restored with it):
``"untrained"``, the flat indices of the parameters without a gradient so far; ``"tracked"``,
how many parameters that list covers (a group added later extends it); ``"cohort_starts"``,
flat index → the step its cohort began. Only communicating steps count: their verdict is the
same on every rank, so every rank moves the same parameters at the same step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Cohorts", "cohort_starts", "late_starters", "refuse_late_start", "start_cohorts"]


@dataclasses.dataclass(frozen=True)
class Cohorts:
    """What the bucket layout needs: the parameters (flat indices) with a first step of their
    own, and those never trained, which get no bucket and no state (as in torch.optim)."""

    starts: Mapping[int, int] = dataclasses.field(default_factory=dict)
    untrained: frozenset[int] = frozenset()

    @classmethod
    def of(cls, schedule: Mapping[str, Any]) -> Cohorts:
        return cls(
            dict(schedule.get("cohort_starts", {})), frozenset(schedule.get("untrained", ()))
        )


def cohort_starts(schedule: dict[str, Any]) -> dict[int, int]:
    """Flat parameter index → the step its cohort began, for the parameters that started late."""
    return schedule.get("cohort_starts", {})


def late_starters(
    schedule: dict[str, Any],
    without_grad: Sequence[int],
    param_groups: Sequence[dict[str, Any]],
    step: int,
) -> list[int]:
    """Note this step's gradients (``without_grad``: the agreed flat indices of parameters with
    none on any rank) and return those that get their first one now, after a step without."""
    count = sum(len(g["params"]) for g in param_groups)
    if "tracked" not in schedule and schedule.get("step", 0) > 0:
        # a schedule from before this note (an older commopt's state dict): what it held had
        # trained, as far as anyone can tell; starting them anew would restart their warmup
        schedule["tracked"], schedule["untrained"] = count, []
    tracked = schedule.get("tracked", 0)
    if tracked == count and not schedule.get("untrained"):
        return []  # every parameter has trained: nothing to note (the usual case)
    starts = [g["first_step"] for g in param_groups for _ in g["params"]]
    untrained = set(schedule.get("untrained", ())) | set(range(tracked, len(starts)))
    trained_now = untrained - set(without_grad)
    own = cohort_starts(schedule)
    late = sorted(i for i in trained_now if step - 1 > own.get(i, starts[i]))
    schedule["untrained"] = sorted(untrained - trained_now)
    schedule["tracked"] = len(starts)
    return late


def start_cohorts(schedule: dict[str, Any], late: Sequence[int], step: int) -> None:
    """``late`` start their cohort at ``step`` − 1 (lay the buckets out again afterwards)."""
    schedule["cohort_starts"] = {**cohort_starts(schedule), **{i: step - 1 for i in late}}


def refuse_late_start(name: str, late: Sequence[int], where: Sequence[str], step: int) -> None:
    """0/1 Adam after ``var_freeze_step``: v is frozen, a late parameter could never get one."""
    raise ValueError(
        f"{name}: {', '.join(where[:3])}{' …' if len(late) > 3 else ''} got a first gradient at "
        f"step {step}, after var_freeze_step: its variance was never estimated and is now "
        "frozen, so it could never move. Unfreeze it before the variance freezes, or train it "
        "with another optimizer"
    )
