"""An optimizer's buckets: which parameters share a flat buffer, which start late, and what a
resume restores into them.

**Layout** (:class:`BucketLayout`): which parameters share a flat buffer, and their
:class:`FlatState`.

The buckets are laid out at first use (the exchange, which sizes the per-rank buffers, needs the
backend), again when a param group joins, and from scratch after ``load_state_dict``. Groups
that joined at different steps never share a bucket: each runs its own schedule. The exchange
buffers of a loaded state dict wait here until there are buckets to restore them into.

**Cohorts**: parameters that start late, whose first gradient arrives after their group's
first step.

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

**Resume**: the ``"commopt"`` entry of a state dict, exchange buffers back, state kept fp32.

``state_dict()`` is torch's plus ``"commopt"``: the config, the shared schedule state, and this
rank's exchange buffers with the rank and world size they belong to. ``load_state_dict`` checks
the saved config first (a different schedule would move the run into another phase).

The per-rank buffers (error feedback) are restored only into the rank, world size and exchange
they were saved by; anything else resets them to zero with one warning (never another rank's
buffers, which would silently bias this rank's compression).
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch

from commopt.buckets import Bucket, build_buckets
from commopt.comm import Backend
from commopt.exchange import Exchange
from commopt.optim.adam import variance_steps_through
from commopt.optim.config import check_config_change
from commopt.optim.flat_state import FlatState
from commopt.sharding import Sharding

__all__ = [
    "BucketLayout",
    "Cohorts",
    "check_bucket_numels",
    "cohort_starts",
    "commopt_entry",
    "keep_state_dtypes",
    "late_starters",
    "refuse_late_start",
    "restorable_buckets",
    "restore_comm",
    "split_commopt_entry",
    "start_cohorts",
    "upgrade_zero_one_groups",
]


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


class BucketLayout:
    """An optimizer's buckets, their state, and loaded exchange buffers not yet restored.

    Args:
        name: the optimizer's class name, for the warnings.
        keys: flat keys allocated with the bucket (``FlatState``'s ``keys``).
        lazy_keys: flat keys allocated on first use.
        scalar_keys: per-tensor scalar keys and their initial values.
    """

    def __init__(
        self,
        name: str,
        keys: Sequence[str],
        lazy_keys: Sequence[str],
        scalar_keys: Mapping[str, float],
        bucket_per_group: bool = False,
    ) -> None:
        self.name = name
        self.keys = tuple(keys)
        self.lazy_keys = tuple(lazy_keys)
        self.scalar_keys = dict(scalar_keys)
        #: one FlatState per bucket; None until laid out (or after a load)
        self.states: list[FlatState] | None = None
        #: the ``"commopt"`` entry of a loaded state dict, until the buckets exist
        self.pending: dict[str, Any] | None = None
        #: the parameters the layout left out (never trained)
        self.untrained: frozenset[int] = frozenset()
        #: every param group starts a bucket (0/1 Adam: a sync compresses lr-weighted
        #: updates, so groups of different lr must not share one 1-bit scale)
        self.bucket_per_group = bucket_per_group

    def lay_out(
        self,
        param_groups: list[dict[str, Any]],
        param_state: MutableMapping[torch.Tensor, dict[str, Any]],
        bucket_numel: int | None,
        exchange: Exchange,
        backend: Backend,
        cohorts: Cohorts,
        sharding: Sharding | None = None,
    ) -> list[FlatState]:
        """Buckets and their state; a bucket whose parameters are unchanged keeps its exchange
        buffers, and loaded ones are restored into the new buckets. Parameters never trained
        get none, and lose what they had (zeros: they never had a gradient). ``sharding``:
        the parameters are shards (:mod:`commopt.sharding`), and so is their state."""
        keep = {tuple(id(p) for p in s.bucket.params): s for s in self.states or []}
        flat = [p for g in param_groups for p in g["params"]]
        for i in cohorts.untrained:
            if i < len(flat):
                param_state.pop(flat[i], None)
        states = []
        for bucket in _buckets(param_groups, bucket_numel, self.bucket_per_group, cohorts):
            bucket.sharding = sharding
            state = FlatState(
                bucket,
                param_state,
                self.keys,
                self.lazy_keys,
                self.scalar_keys,
                exchange.state_numels(bucket.numel),
            )
            old = keep.get(tuple(id(p) for p in bucket.params))
            if old is not None:
                for key, buf in state.comm.items():
                    buf.copy_(old.comm[key])
            states.append(state)
        if self.pending is not None:
            restore_comm(states, self.pending, backend, exchange.name, self.name)
            self.pending = None
        self.states = states
        self.untrained = cohorts.untrained
        return states

    def check_loadable(
        self,
        saved_groups: list[dict[str, Any]],
        loaded: dict[str, Any] | None,
        param_groups: list[dict[str, Any]],
        bucket_numel: int | None,
        exchange: Exchange,
        backend: Backend,
    ) -> None:
        """ValueError now, not at the next step, when the exchange buffers of ``loaded`` (a
        state dict's ``"commopt"`` entry) would not fit the buckets that ``param_groups`` with
        the ``first_step`` of ``saved_groups`` and the loaded cohorts lay out (the rest:
        :meth:`lay_out`'s)."""
        if not restorable_buckets(loaded, backend, exchange.name):
            return
        groups = [
            {**g, "first_step": s.get("first_step", 0)}
            for g, s in zip(param_groups, saved_groups, strict=True)
        ]
        loaded_cohorts = Cohorts.of((loaded or {}).get("global", {}))
        numels = [
            b.numel for b in _buckets(groups, bucket_numel, self.bucket_per_group, loaded_cohorts)
        ]
        check_bucket_numels(loaded or {}, numels, self.name)

    def forget(self, loaded: dict[str, Any] | None) -> None:
        """Drop the buckets (state was loaded: laid out anew at the next use); ``loaded``, the
        state dict's ``"commopt"`` entry, is restored into them then."""
        self.states = None
        if loaded is not None:
            self.pending = loaded

    def comm_state_dicts(self) -> list[dict[str, Any]]:
        """This rank's exchange buffers per bucket (the loaded ones while not laid out)."""
        buckets = [s.comm_state_dict() for s in self.states or []]
        if self.pending is not None and not buckets:
            buckets = self.pending.get("buckets", [])
        return buckets


def _buckets(
    param_groups: list[dict[str, Any]],
    bucket_numel: int | None,
    per_group: bool,
    cohorts: Cohorts,
) -> list[Bucket]:
    """The buckets of ``param_groups``: parameters that joined at another step (a group added
    later, or a parameter with a cohort of its own) start a new one; with ``per_group``, so does
    every group. Parameters never trained are left out."""
    runs: list[dict[str, Any]] = []  # consecutive parameters of one group and one first step
    owner: list[int] = []  # each run's param group
    index = 0
    for gi, group in enumerate(param_groups):
        for p in group["params"]:
            first = cohorts.starts.get(index, group["first_step"])
            index += 1
            if index - 1 in cohorts.untrained:
                continue
            if not runs or owner[-1] != gi or runs[-1]["first_step"] != first:
                runs.append({"params": [], "first_step": first})
                owner.append(gi)
            runs[-1]["params"].append(p)
    new_at = [
        i
        for i in range(1, len(runs))
        if (per_group and owner[i] != owner[i - 1])
        or runs[i]["first_step"] != runs[i - 1]["first_step"]
    ]
    buckets = build_buckets(runs, bucket_numel, new_at)
    for bucket in buckets:  # segments name the param group, not the run
        bucket.first_step = runs[bucket.segments[0].group]["first_step"]
        bucket.segments = [dataclasses.replace(s, group=owner[s.group]) for s in bucket.segments]
    return buckets


def commopt_entry(
    config: Any,
    global_state: dict[str, Any],
    backend: Backend,
    exchange_name: str,
    buckets: list[dict[str, Any]],
    name: str,
) -> dict[str, Any]:
    """The ``"commopt"`` entry of ``state_dict()``: the optimizer class ``name``, the config,
    the shared schedule state, and this rank's exchange buffers (``buckets``) with the rank and
    world size they belong to."""
    return {
        "optimizer": name,
        "config": dataclasses.asdict(config),
        "global": copy.deepcopy(global_state),
        "world_size": backend.world_size,
        "rank": backend.rank,
        "exchange": exchange_name,
        "buckets": buckets,
    }


def saved_optimizer(comm: dict[str, Any]) -> str | None:
    """The class that saved a ``"commopt"`` entry: recorded since 0.2; before, told by the
    config's fields (each optimizer's config has a field the others lack)."""
    if "optimizer" in comm:
        return comm["optimizer"]
    fields = comm.get("config") or {}
    if "var_freeze_step" in fields:
        return "ZeroOneAdam"
    if "max_coeff" in fields:
        return "OnebitLamb"
    if "freeze_step" in fields:
        return "OnebitAdam"
    return None


def split_commopt_entry(
    state_dict: dict[str, Any],
    config: Any,
    name: str,
    allow_config_change: bool,
    param_groups: list[dict[str, Any]],
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """torch's part of ``state_dict`` and its ``"commopt"`` entry (None: saved by torch or
    without one), after checking the saved config against ``config``
    (:func:`~commopt.optim.config.check_config_change`) and the saved groups' sizes against
    ``param_groups`` (torch's own check, made here so that it comes before any other change)."""
    saved_groups = state_dict.get("param_groups", [])
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"{name}.load_state_dict: the state dict has {len(saved_groups)} parameter "
            f"group(s), this optimizer {len(param_groups)}"
        )
    sizes = [len(g["params"]) for g in saved_groups], [len(g["params"]) for g in param_groups]
    if sizes[0] != sizes[1]:
        raise ValueError(
            f"{name}.load_state_dict: the state dict's parameter groups hold {sizes[0]} "
            f"parameters, this optimizer's {sizes[1]}"
        )
    state_dict = dict(state_dict)
    comm = state_dict.pop("commopt", None)
    if comm is None and any("first_step" in g for g in saved_groups):
        # commopt's groups carry first_step; torch's state-dict API keeps only "state" and
        # "param_groups", and loading what is left would restart the schedule silently
        raise ValueError(
            f"{name}.load_state_dict: this state dict was saved by a commopt optimizer but "
            "has lost its 'commopt' part (the step count, the freeze point and the error "
            "buffers), as torch.distributed.checkpoint.state_dict's get_state_dict / "
            "get_optimizer_state_dict drop it; save optimizer.state_dict() whole, or use "
            "commopt.save_checkpoint (commopt.fsdp.save_checkpoint on FSDP2)"
        )
    saved_by = None if comm is None else saved_optimizer(comm)
    if saved_by is not None and saved_by != name:
        raise ValueError(
            f"{name}.load_state_dict: this state dict was saved by {saved_by}, whose state "
            f"(moments, schedule, exchange buffers) {name} cannot continue; load it into a "
            f"{saved_by}, or start {name} from a fresh state"
        )
    if comm is not None and "config" in comm:
        check_config_change(comm["config"], config, name, allow_config_change)
    return state_dict, comm


def restore_comm(
    states: list[FlatState],
    comm: dict[str, Any],
    backend: Backend,
    exchange_name: str,
    name: str,
) -> None:
    """This rank's exchange buffers from a state dict, or zeros with one warning when they
    belong to another world size, rank or exchange (never another rank's buffers)."""
    saved = comm.get("buckets", [])
    if not saved:  # saved before the first step, or reset on purpose: errors stay zero
        return
    reason = _not_restorable(comm, backend, exchange_name)
    if reason is not None:
        warnings.warn(
            f"{name}: this rank's error-feedback buffers were {reason}; they "
            "are reset to zero (everything else is restored)",
            stacklevel=4,
        )
        return
    check_bucket_numels(comm, [s.bucket.numel for s in states], name)
    for state, entry in zip(states, saved, strict=True):
        state.load_comm_state_dict(entry)


def check_bucket_numels(comm: dict[str, Any], numels: list[int], name: str) -> None:
    """ValueError when ``comm``'s saved exchange buffers do not fit buckets of ``numels``."""
    saved = [b["numel"] for b in comm.get("buckets", [])]
    if saved and saved != numels:
        raise ValueError(
            f"{name}.load_state_dict: the saved exchange buffers do not fit this optimizer's "
            f"buckets: saved {saved} elements per bucket, here {numels} (another "
            "bucket_numel, or other parameters): construct it with the saved bucket_numel"
        )


def restorable_buckets(comm: dict[str, Any] | None, backend: Backend, exchange_name: str) -> bool:
    """Whether :func:`restore_comm` will restore ``comm``'s buffers (not reset them)."""
    if comm is None or not comm.get("buckets"):
        return False
    return _not_restorable(comm, backend, exchange_name) is None


def _not_restorable(comm: dict[str, Any], backend: Backend, exchange_name: str) -> str | None:
    """Why ``comm``'s buffers belong to another rank, world size or exchange (None: they fit)."""
    be = backend
    reason = None
    if comm.get("world_size") != be.world_size:
        reason = f"saved at world size {comm.get('world_size')}, now {be.world_size}"
    elif comm.get("rank") != be.rank:
        reason = (
            f"saved by rank {comm.get('rank')}, loaded on rank {be.rank} (save each rank's "
            "own optimizer.state_dict(), or use commopt.save_checkpoint)"
        )
    elif comm.get("exchange", "flat") != exchange_name:
        reason = f"saved for the {comm.get('exchange')!r} exchange, now {exchange_name!r}"
    return reason


def keep_state_dtypes(
    state: dict[torch.Tensor, dict[str, Any]],
    param_groups: list[dict[str, Any]],
    state_dict: dict[str, Any],
) -> None:
    """Undo torch's cast of loaded state to the parameter's dtype in ``state`` (an optimizer's,
    just loaded from ``state_dict``): the optimizer state is fp32 even for bf16/fp16
    parameters, and a round trip through bf16 would lose bits."""
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = [p for g in param_groups for p in g["params"]]
    for saved_id, p in zip(saved_ids, params, strict=True):
        for key, value in state_dict["state"].get(saved_id, {}).items():
            if (
                isinstance(value, torch.Tensor)
                and value.is_floating_point()
                and value.dtype != p.dtype
                and key != "step"
            ):
                state[p][key] = value.to(device=p.device, copy=True)


def upgrade_zero_one_groups(groups: list[dict[str, Any]], var_update_scaler: int) -> None:
    """0/1 Adam's param groups of a state dict saved by an older commopt: without
    ``bias_correction`` v was used as it is (False); without ``variance_offset`` the group
    counts the variance steps before it joined (replayed from the schedule)."""
    for group in groups:
        group.setdefault("bias_correction", False)
        if "variance_offset" not in group:
            group["variance_offset"] = variance_steps_through(
                group["first_step"], var_update_scaler
            )
