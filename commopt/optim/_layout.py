"""Which parameters share a flat buffer: an optimizer's buckets and their :class:`FlatState`.

The buckets are laid out at first use (the exchange, which sizes the per-rank buffers, needs the
backend), again when a param group joins, and from scratch after ``load_state_dict``. Groups
that joined at different steps never share a bucket: each runs its own schedule. The exchange
buffers of a loaded state dict wait here until there are buckets to restore them into.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch

from commopt.buckets import Bucket, build_buckets
from commopt.comm import Backend
from commopt.exchange import Exchange
from commopt.optim._cohorts import Cohorts
from commopt.optim._resume import check_bucket_numels, restorable_buckets, restore_comm
from commopt.optim.flat_state import FlatState

__all__ = ["BucketLayout"]


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
        self.bucket_per_group = False

    def lay_out(
        self,
        param_groups: list[dict[str, Any]],
        param_state: MutableMapping[torch.Tensor, dict[str, Any]],
        bucket_numel: int | None,
        exchange: Exchange,
        backend: Backend,
        cohorts: Cohorts,
    ) -> list[FlatState]:
        """Buckets and their state; a bucket whose parameters are unchanged keeps its exchange
        buffers, and loaded ones are restored into the new buckets. Parameters never trained
        get none, and lose what they had (zeros: they never had a gradient)."""
        keep = {tuple(id(p) for p in s.bucket.params): s for s in self.states or []}
        flat = [p for g in param_groups for p in g["params"]]
        for i in cohorts.untrained:
            if i < len(flat):
                param_state.pop(flat[i], None)
        states = []
        for bucket in _buckets(param_groups, bucket_numel, self.bucket_per_group, cohorts):
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
        param_state: Any,
        bucket_numel: int | None,
        exchange: Exchange,
        backend: Backend,
        cohorts: Cohorts,
    ) -> None:
        """ValueError now, not at the next step, when the exchange buffers of ``loaded`` (a
        state dict's ``"commopt"`` entry) would not fit the buckets that ``param_groups`` with
        the ``first_step`` of ``saved_groups`` lay out (the rest: :meth:`lay_out`'s)."""
        del param_state, cohorts  # (the loaded state's cohorts count, not this optimizer's)
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
