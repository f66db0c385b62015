"""What the constructors and ``add_param_group`` refuse, beyond the schedule's own checks
(:mod:`.config`): param groups the flat fp32 state cannot represent, an invalid ``overlap`` or
``bucket_numel``, and 0/1 Adam's groups that would join after its variance froze."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from commopt.optim.config import check_number

__all__ = [
    "check_group_joins_phase_a",
    "check_no_scaler_after_early_work",
    "check_overlap_arguments",
    "check_param_group",
]


#: torch.optim.Adam's options that commopt's optimizers do not have, and why
_TORCH_ONLY = {
    "maximize": "negate the loss instead",
    "amsgrad": "the frozen variance is what 1-bit and 0/1 Adam compress against",
    "capturable": "no CUDA-graph capture of a step that communicates",
    "differentiable": "no autograd through the step",
    "fused": "commopt's own flat kernels run the step",
}


def check_param_group(
    group: dict[str, Any], name: str, config: Any, defaults: dict[str, Any]
) -> None:
    """Refuse what the flat fp32 state cannot represent, naming the way out."""
    for key in dataclasses.asdict(config):
        if key in group and key not in defaults:
            raise ValueError(
                f"{key} is one setting for the whole {name} (its config), "
                f"not per param group; pass {key}= to the constructor"
            )
    for key in ("lr", "eps", "weight_decay"):
        if key in group:
            check_number(f"{key} in a param group", group[key])
    for i, beta in enumerate(group.get("betas", ())):
        check_number(f"betas[{i}] in a param group", beta)
    for key, why in _TORCH_ONLY.items():
        if group.get(key):
            raise ValueError(
                f"{key}={group[key]!r} in a param group: {name} has no {key} ({why}); "
                "remove it (the constructor refuses it too)"
            )
    for p in group["params"]:
        if p.is_complex():
            raise TypeError(
                f"{name} does not support complex parameters (got {p.dtype}): "
                "the 1-bit code has no phase; optimize torch.view_as_real(p) instead"
            )
        if p.dtype == torch.float64:
            raise TypeError(
                f"{name} keeps fp32 state and communicates fp32, so a float64 "
                "parameter would silently lose precision; convert the model with "
                ".float() (or use torch.optim.Adam for float64)"
            )
        if p.device.type == "meta":
            raise ValueError(
                f"{name} got a parameter on the meta device (shape "
                f"{tuple(p.shape)}): materialise the model (e.g. model.to_empty(device=...) "
                "and load its weights) before creating the optimizer"
            )
    mask = group.get("exp_avg_mask")
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"exp_avg_mask must be a tensor, got {type(mask).__name__}")
    for p in group["params"]:
        try:
            torch.broadcast_shapes(mask.shape, p.shape)
        except RuntimeError:
            raise ValueError(
                f"exp_avg_mask of shape {tuple(mask.shape)} does not broadcast to a parameter "
                f"of shape {tuple(p.shape)} in its group"
            ) from None


def check_overlap_arguments(
    overlap: bool, bucket_numel: int | None, default: int | None
) -> int | None:
    """The constructors' ``overlap`` and ``bucket_numel``, checked; the bucket size to use
    (``default``, the class's, when ``bucket_numel`` is None)."""
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be True or False, got {overlap!r}")
    if bucket_numel is None:
        return default
    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int):
        raise TypeError(f"bucket_numel must be an int, got {type(bucket_numel).__name__}")
    if bucket_numel < 1:
        raise ValueError(f"Invalid bucket_numel: {bucket_numel} (must be >= 1)")
    return bucket_numel


def check_group_joins_phase_a(step: int, frozen: float | None) -> None:
    """0/1 Adam: parameters may join in phase A only (``frozen``: T_v, None while the
    constructor adds its groups): after it v is frozen, and new parameters would never get one."""
    if frozen is not None and step > frozen:
        raise ValueError(
            f"ZeroOneAdam cannot add a param group at step {step}, after var_freeze_step = "
            f"{frozen}: the variance is frozen and new parameters would "
            "never get one. Add the group before the freeze, or give its parameters an "
            "optimizer of their own"
        )


def check_no_scaler_after_early_work(name: str, started_early: bool) -> None:
    """A GradScaler's scale with early work (the DDP hook, ``overlap=True``) that already used
    the gradients during backward, before the scaler could unscale them: refused."""
    if started_early:
        raise RuntimeError(
            f"{name}: a DDP hook or overlap=True used the gradients during backward, before "
            "GradScaler could unscale them; with the commopt DDP hook or overlap, use bf16 "
            "autocast (no GradScaler) or a static loss scale folded into lr"
        )
