"""Resuming: the ``"commopt"`` entry of a state dict, exchange buffers back, state kept fp32.

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
from typing import Any

import torch

from commopt.comm import Backend
from commopt.optim._adam import variance_steps_through
from commopt.optim.config import check_config_change
from commopt.optim.flat_state import FlatState

__all__ = [
    "check_bucket_numels",
    "commopt_entry",
    "keep_state_dtypes",
    "restorable_buckets",
    "restore_comm",
    "split_commopt_entry",
    "upgrade_zero_one_groups",
]


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
