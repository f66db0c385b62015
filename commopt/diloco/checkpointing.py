r""":class:`~commopt.diloco.DiLoCo`'s state dict: what it holds and how it is checked on load.

Layout (torch's, so :func:`commopt.save_checkpoint` splits it like any optimizer's)::

    "state":        {index: {inner optimizer's keys..., "diloco_anchor": θ̄ of that parameter,
                             "diloco_outer_momentum": b (only with outer momentum)}}
    "param_groups": the inner optimizer's
    "commopt":      this rank's part: {"kind": "diloco", "world_size", "rank", "layout" (the
                    average and its exchange), "settings", "step", "syncs", "fp32_syncs_run",
                    "last_sync", "bytes",
                    "buckets": [the error buffers of each segment of each fragment],
                    "pending": [a delayed sync in flight: its fragment, the step it is
                    applied after, its average],
                    "inner": the inner optimizer's own "commopt" part, if it has one}

The anchors are identical on every rank (so a checkpoint writes them once); the inner state and
the error buffers are per rank. ``"buckets": []`` (what :func:`commopt.load_checkpoint` passes
at another world size) restores zero error buffers. Loading checks everything first and changes
nothing when it refuses: a ``ValueError`` names what does not fit.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import warnings
from typing import Any

import torch

from commopt.comm import Backend
from commopt.diloco.averages import PseudoGradientAverage, local_shard
from commopt.diloco.fragments import Fragment
from commopt.diloco.schedule import Progress

__all__ = ["Parts", "load_state_dict", "state_dict"]


@dataclasses.dataclass(frozen=True)
class Parts:
    """What the state dict reads and writes of a :class:`commopt.diloco.DiLoCo`, handed over
    as values: its inner optimizer, backend, average, fragments, progress (written in place
    on load) and settings."""

    inner: torch.optim.Optimizer
    backend: Backend
    average: PseudoGradientAverage
    parts: list[Fragment]
    progress: Progress
    settings: dict[str, int]


_ANCHOR, _MOMENTUM = "diloco_anchor", "diloco_outer_momentum"
#: settings added after the first release, at the value a state dict saved without them had
_ADDED_SETTINGS = {"fp32_syncs": 0}


def _layout(own: Parts) -> str:
    exchange = getattr(own.average, "exchange", None)
    return own.average.name + (f":{exchange.name}" if exchange is not None else "")


def _indices(own: Parts) -> dict[int, int]:
    """id(parameter) → its index in the inner optimizer's state dict (param_groups order)."""
    params = [p for g in own.inner.param_groups for p in g["params"]]
    return {id(p): i for i, p in enumerate(params)}


def state_dict(own: Parts) -> dict[str, Any]:
    """The state dict of the DiLoCo whose parts are ``own`` (module docstring); waits for a
    delayed sync in flight."""
    pending = [
        {"fragment": p, "apply_at": at, "average": future.result().clone()}
        for p, (future, at) in sorted(own.progress.pending.items())
    ]
    inner = own.inner.state_dict()
    index = _indices(own)
    state = {k: dict(v) if isinstance(v, dict) else v for k, v in inner["state"].items()}
    for frag in own.parts:
        moms = frag.views(frag.momentum) if frag.momentum is not None else None
        for j, (p, anchor) in enumerate(zip(frag.params, frag.views(frag.anchor), strict=True)):
            entry = state.setdefault(index[id(p)], {})
            entry[_ANCHOR] = anchor
            if moms is not None:
                entry[_MOMENTUM] = moms[j]
    comm = {
        "kind": "diloco",
        "world_size": own.backend.world_size,
        "rank": own.backend.rank,
        "layout": _layout(own),
        "settings": own.settings,
        "step": own.progress.step,
        "syncs": own.progress.syncs,
        "fp32_syncs_run": own.progress.fp32_syncs_run,
        "skipped": own.progress.skipped,
        "last_sync": list(own.progress.last_sync),
        "bytes": dict(own.progress.bytes),
        "buckets": [dict(state) for frag in own.parts for state in frag.states],
        "pending": pending,
        "inner": inner.get("commopt"),
    }
    return {"state": state, "param_groups": inner["param_groups"], "commopt": comm}


def _check(own: Parts, sd: dict[str, Any]) -> bool:
    """Raise ``ValueError`` unless ``sd`` fits ``own``; returns whether the saved error buffers
    are to be restored (False: reset to zero, with a warning where that is news)."""
    comm = sd.get("commopt") if isinstance(sd, dict) else None
    if not isinstance(comm, dict) or comm.get("kind") != "diloco":
        raise ValueError(
            "DiLoCo.load_state_dict: this is not a DiLoCo state dict (no 'commopt' part of kind "
            "'diloco'); to load the inner optimizer's own state, call opt.inner.load_state_dict. "
            "torch.distributed.checkpoint.state_dict's get_state_dict / get_optimizer_state_dict "
            "keep only 'state' and 'param_groups': save opt.state_dict() whole, or use "
            "commopt.save_checkpoint (commopt.fsdp.save_checkpoint on FSDP2)"
        )
    mine = own.settings
    saved = {**_ADDED_SETTINGS, **comm.get("settings", {})}
    differ = [k for k in mine if saved.get(k) != mine[k]]
    if differ:
        raise ValueError(
            "DiLoCo.load_state_dict: the state was saved with other settings: "
            + "; ".join(f"{k} saved {saved.get(k)}, here {mine[k]}" for k in differ)
            + " (floats as their bits); build the DiLoCo with the saved settings"
        )
    index = _indices(own)
    for frag in own.parts:
        for p in frag.params:
            entry = sd["state"].get(index[id(p)], {})
            shape = local_shard(p).shape  # (an FSDP2 parameter's anchor is its shard's)
            for key, needed in ((_ANCHOR, True), (_MOMENTUM, frag.momentum is not None)):
                t = entry.get(key)
                t = local_shard(t) if isinstance(t, torch.Tensor) else t  # (a DTensor from DCP)
                if needed and (not isinstance(t, torch.Tensor) or t.shape != shape):
                    raise ValueError(
                        f"DiLoCo.load_state_dict: parameter {index[id(p)]} has no {key} of shape "
                        f"{tuple(shape)} (got {None if t is None else tuple(t.shape)})"
                    )
    for item in comm.get("pending", []):
        frag = own.parts[item["fragment"]] if 0 <= item["fragment"] < len(own.parts) else None
        if frag is None or item["average"].numel() != frag.numel:
            raise ValueError("DiLoCo.load_state_dict: a delayed sync does not fit the fragments")
    buckets = comm.get("buckets", [])
    if not buckets:
        return False
    n, rank = own.backend.world_size, own.backend.rank
    reason = None
    if comm.get("world_size") != n or comm.get("layout") != _layout(own):
        reason = (
            f"saved for {comm.get('layout')!r} at world size {comm.get('world_size')}, this is "
            f"{_layout(own)!r} at {n}"
        )
    elif comm.get("rank") != rank:  # one rank's file loaded everywhere (HF Trainer, say)
        reason = (
            f"saved by rank {comm.get('rank')}, loaded on rank {rank} (save each rank's own "
            "opt.state_dict(), or use commopt.save_checkpoint)"
        )
    if reason is not None:
        warnings.warn(
            f"DiLoCo.load_state_dict: the error buffers were {reason}: they are reset to zero "
            "(everything else is restored)",
            stacklevel=3,
        )
        return False
    states = [state for frag in own.parts for state in frag.states]
    for k, (state, saved_state) in enumerate(zip(states, buckets, strict=False)):
        sizes = {key: v.numel() for key, v in saved_state.items()}
        here = {key: v.numel() for key, v in state.items()}
        if len(buckets) != len(states) or sizes != here:
            raise ValueError(
                f"DiLoCo.load_state_dict: {len(buckets)} saved error-buffer sets for "
                f"{len(states)} here, or set {k} does not fit (saved {sizes}, here {here})"
            )
    return True


def load_state_dict(own: Parts, sd: dict[str, Any]) -> None:
    """Restore ``sd`` into the DiLoCo whose parts are ``own`` (module docstring)."""
    restore_errors = _check(own, sd)
    for future, _ in own.progress.pending.values():  # nothing may write the buffers meanwhile
        concurrent.futures.wait([future])
    comm = sd["commopt"]
    inner_state = {}
    for k, entry in sd["state"].items():
        kept = {key: v for key, v in entry.items() if key not in (_ANCHOR, _MOMENTUM)}
        if kept:
            inner_state[k] = kept
    inner: dict[str, Any] = {"state": inner_state, "param_groups": sd["param_groups"]}
    if comm.get("inner") is not None:
        inner["commopt"] = comm["inner"]
        if not restore_errors:
            n, r = own.backend.world_size, own.backend.rank
            inner["commopt"] = {**comm["inner"], "world_size": n, "rank": r, "buckets": []}
    own.inner.load_state_dict(inner)  # checks its own part before it changes anything

    index = _indices(own)
    with torch.no_grad():
        states = [state for frag in own.parts for state in frag.states]
        saved = comm["buckets"] if restore_errors else [{} for _ in states]
        for state, saved_state in zip(states, saved, strict=True):
            for key, buf in state.items():
                if restore_errors:
                    buf.copy_(saved_state[key])
                else:
                    buf.zero_()
        for frag in own.parts:
            for j, (p, anchor) in enumerate(zip(frag.params, frag.views(frag.anchor), strict=True)):
                entry = sd["state"][index[id(p)]]
                anchor.copy_(local_shard(entry[_ANCHOR]))
                if frag.momentum is not None:
                    frag.views(frag.momentum)[j].copy_(local_shard(entry[_MOMENTUM]))
    own.progress.step = int(comm["step"])
    own.progress.syncs = int(comm.get("syncs", 0))
    own.progress.fp32_syncs_run = int(comm.get("fp32_syncs_run", 0))
    own.progress.skipped = int(comm.get("skipped", 0))  # since 2026-11-28
    own.progress.last_sync[:] = [int(t) for t in comm["last_sync"]]
    own.progress.bytes.update({"fp32": 0, **comm.get("bytes", {})})  # "fp32": since 2026-11-28
    own.progress.pending.clear()
    for item in comm.get("pending", []):
        frag = own.parts[item["fragment"]]
        frag.delta.copy_(item["average"])
        done: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
        done.set_result(frag.delta)
        own.progress.pending[item["fragment"]] = (done, int(item["apply_at"]))
