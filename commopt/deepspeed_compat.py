"""Build a commopt optimizer from a DeepSpeed config: a home for DeepSpeed's 1-bit users.

DeepSpeed's ``OneBitAdam``, ``OneBitLamb`` and ``ZeroOneAdam`` were configured by the
``"optimizer"`` block of its JSON config. :func:`from_deepspeed_config` reads that block (or the
whole config, or a path to it) and returns :class:`commopt.OnebitAdam`,
:class:`commopt.OnebitLamb` or :class:`commopt.ZeroOneAdam` with the same hyperparameters.

Every key DeepSpeed accepted is handled one of three ways (``docs/migrating-from-deepspeed.md``
has the full table):

- *honoured*: passed on with the same meaning (lr, betas, eps, weight_decay, the LAMB
  coefficients, 0/1 Adam's schedule …), or translated where the meaning differs: DeepSpeed's
  first ``step()`` only initialises state and is counted, so its ``freeze_step`` F gives
  F − 1 warmup updates, and becomes commopt's ``freeze_step = max(F − 1, 1)`` (the
  step-counting note in :mod:`commopt.deepspeed_keys` has the details);
- *no meaning here*: accepted, and listed in one :class:`DeepSpeedConfigWarning` together with
  what to do instead (``max_grad_norm``: clip before ``step()``; ``eps_inside_sqrt=False``, …);
- *refused*: a value commopt cannot honour (``amsgrad=True``, ``eps_inside_sqrt=True``) or a
  key DeepSpeed did not know either — a ``ValueError`` naming it and the valid keys.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from commopt.comm import Backend
from commopt.deepspeed_keys import (
    BACKENDS,
    COMMON_NO_MEANING,
    ENGINE_KEYS,
    FREEZE_SHIFTED,
    REFUSED_VALUES,
    SPECS,
    checked,
)
from commopt.optim.freeze import auto_settings

__all__ = [
    "DeepSpeedConfigWarning",
    "from_deepspeed_config",
    "to_deepspeed_config",
    "translate_deepspeed_config",
]


class DeepSpeedConfigWarning(UserWarning):
    """Keys of a DeepSpeed config that have no meaning in commopt (listed, with what to do)."""


def _load_block(config: Mapping[str, Any] | str | os.PathLike[str]) -> tuple[dict, list[str]]:
    """The optimizer block, and the engine-level keys of a whole config that commopt ignores."""
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(
                f"cannot read the DeepSpeed config {os.fspath(config)!r}: {err}"
            ) from err
    if not isinstance(config, Mapping):
        raise TypeError(
            "config must be a dict, a JSON path or an 'optimizer' block, got "
            f"{type(config).__name__}"
        )
    engine = []
    if "optimizer" in config:
        engine = [k for k in config if k in ENGINE_KEYS]
        block = config["optimizer"]
    elif "type" in config:
        block = config
    else:
        raise ValueError(
            "config has neither an 'optimizer' block nor a 'type': pass a whole DeepSpeed config "
            "or its 'optimizer' block, e.g. {'type': 'OneBitAdam', 'params': {...}}"
        )
    if not isinstance(block, Mapping) or "type" not in block:
        raise ValueError("the 'optimizer' block must be a dict with a 'type' and 'params'")
    extra_block_keys = sorted(set(block) - {"type", "params"})
    if extra_block_keys:
        raise ValueError(
            f"unknown key(s) {extra_block_keys} in the 'optimizer' block: it takes 'type' and "
            "'params' only"
        )
    return dict(block), engine


def translate_deepspeed_config(
    config: Mapping[str, Any] | str | os.PathLike[str],
) -> tuple[str, dict[str, Any], dict[str, str]]:
    """Translate a DeepSpeed optimizer config without building anything.

    Returns:
        ``(class_name, kwargs, ignored)``: the commopt class name (``"OnebitAdam"`` …), the
        keyword arguments it takes (without ``backend``), and for every key with no meaning in
        commopt the reason (also for the ``"backend"`` choice, under ``"comm_backend_name"``).
        ``kwargs["backend_spec"]`` is ``(comm_backend_name, cuda_aware)``.

    Raises:
        ValueError: an unknown optimizer type, an unknown key, a refused value, or ``"auto"``.
    """
    return _translate(*_load_block(config))


def _translate(
    block: Mapping[str, Any], engine: list[str], skip: frozenset[str] = frozenset()
) -> tuple[str, dict[str, Any], dict[str, str]]:
    type_name = str(block["type"])
    spec = SPECS.get(type_name.lower())
    if spec is None:
        raise ValueError(
            f"unsupported optimizer type {type_name!r}: commopt replaces DeepSpeed's 'OneBitAdam', "
            "'OneBitLamb' and 'ZeroOneAdam' (any letter case); for other types use torch.optim"
        )
    raw = block.get("params")
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise TypeError(
            f"{type_name} 'params' = {raw!r} is {type(raw).__name__}; expected a dict of "
            'keyword arguments (a JSON object such as {"lr": 1e-3, "freeze_step": 1000})'
        )
    params = {k: v for k, v in raw.items() if k not in skip}
    known = set(spec["honoured"]) | set(spec["no_meaning"]) | set(COMMON_NO_MEANING)
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(
            f"unknown key(s) {unknown} in the {type_name} params; DeepSpeed's {type_name} takes "
            f"{sorted(known)}"
        )
    for key, value in params.items():
        if isinstance(value, str) and value == "auto":
            raise ValueError(
                f"{type_name} param {key!r} is 'auto', which only the Hugging Face integration "
                "fills in; give a value, or pass it as a keyword to from_deepspeed_config"
            )
        params[key] = value = checked(type_name, key, value)
        refused = REFUSED_VALUES.get(key)
        if refused is not None and value == refused[0]:
            raise ValueError(f"{type_name} param {key}={value!r} is refused: {refused[1]}")

    kwargs = {k: params[k] for k in spec["honoured"] if k in params}
    for key in FREEZE_SHIFTED:
        if key in kwargs:  # DeepSpeed counts its initialising step (note above)
            if kwargs[key] < 0:
                raise ValueError(f"{type_name} param {key}={kwargs[key]} must be >= 0")
            kwargs[key] = max(kwargs[key] - 1, 1)
    if kwargs.get("var_freeze_step") == 0:  # DeepSpeed's 0 still gives one phase-A update
        kwargs["var_freeze_step"] = 1

    ignored: dict[str, str] = {}
    for key in sorted(set(params) & (set(spec["no_meaning"]) | set(COMMON_NO_MEANING))):
        if key in ("comm_backend_name", "cuda_aware"):
            continue
        reason = spec["no_meaning"].get(key) or COMMON_NO_MEANING[key]
        ignored[key] = f"{key}={params[key]!r}: {reason}"

    comm = params.get("comm_backend_name", "nccl").lower()
    if comm not in BACKENDS:
        raise ValueError(
            f"{type_name} param comm_backend_name={params['comm_backend_name']!r} is unknown; "
            f"expected one of {list(BACKENDS)}"
        )
    cuda_aware = params.get("cuda_aware", False)
    if cuda_aware and comm != "mpi":
        ignored["cuda_aware"] = (
            f"cuda_aware=True with comm_backend_name={comm!r}: only MPI uses it; ignored"
        )
    kwargs["backend_spec"] = (comm, cuda_aware)
    for key in engine:
        ignored[key] = f"top-level {key!r} configured DeepSpeed's engine: {ENGINE_KEYS[key]}"
    return spec["class"], kwargs, ignored


def _make_backend(comm: str, cuda_aware: bool) -> Backend | None:
    if comm == "mpi":
        from commopt.comm import MpiBackend

        return MpiBackend(cuda_aware=cuda_aware)
    # "nccl", "gloo" and DeepSpeed's "compressed" all ran over torch.distributed: resolve lazily
    # (commopt.init()'s backend, else torch.distributed's default group), SPEC §5.
    return None


def from_deepspeed_config(
    params: Any,
    config: Mapping[str, Any] | str | os.PathLike[str],
    *,
    backend: Backend | None = None,
    **overrides: Any,
) -> torch.optim.Optimizer:
    """The commopt optimizer that a DeepSpeed ``optimizer`` config block describes.

    Args:
        params: the parameters or param groups, as for any torch optimizer.
        config: a whole DeepSpeed config (dict), the path of its JSON file, or just its
            ``"optimizer"`` block: ``{"type": "OneBitAdam" | "OneBitLamb" | "ZeroOneAdam"
            (any case), "params": {...}}``.
        backend: use this backend instead of the one ``comm_backend_name`` names.
        **overrides: constructor arguments that replace the config's (e.g. ``lr=3e-4`` where
            the config says ``"auto"``).

    Backends: ``comm_backend_name`` ``"nccl"`` (DeepSpeed's default), ``"gloo"`` and
    ``"compressed"`` become ``backend=None``, resolved at the first step to ``commopt.init()``'s
    backend or torch.distributed's default group (NCCL on GPU, gloo on CPU); ``"mpi"`` becomes
    ``MpiBackend(cuda_aware=cuda_aware)``.

    Returns:
        A :class:`commopt.OnebitAdam`, :class:`commopt.OnebitLamb` or :class:`commopt.ZeroOneAdam`.

    Schedules are translated, not copied: DeepSpeed's ``freeze_step`` F (1-bit Adam, 1-bit
    LAMB) becomes ``max(F − 1, 1)``, which gives the same number of warmup updates, because
    DeepSpeed's first ``step()`` only initialises its state; 0/1 Adam's ``var_freeze_step``
    already gives the same number of phase-A updates and is passed on. ``overrides`` are in
    commopt's own terms and are not translated.

    Raises:
        ValueError: unknown type or key, a refused value, an ``"auto"`` value not overridden.
        TypeError: a value of the wrong JSON type (the string ``"false"`` for a boolean,
            ``"1e-3"`` or ``null`` for a number, ``"params"`` not an object), naming the key,
            the value and the expected type.

    Warns:
        DeepSpeedConfigWarning: once, listing every key that has no meaning in commopt.

    Examples:
        >>> import torch, warnings, commopt
        >>> w = torch.nn.Parameter(torch.zeros(3))
        >>> cfg = {"type": "OneBitAdam", "params": {"lr": 4e-4, "freeze_step": 23000}}
        >>> opt = commopt.from_deepspeed_config([w], cfg)
        >>> type(opt).__name__, opt.freeze_step, opt.param_groups[0]["lr"]
        ('OnebitAdam', 22999, 0.0004)
    """
    block, engine = _load_block(config)
    # Overridden keys may be "auto" in the file: leave them out of the translation.
    class_name, kwargs, ignored = _translate(block, engine, frozenset(overrides))
    comm, cuda_aware = kwargs.pop("backend_spec")
    kwargs.update(overrides)
    if backend is None:
        backend = _make_backend(comm, cuda_aware)
    import commopt.optim as optim

    cls = getattr(optim, class_name, None)
    if cls is None:  # pragma: no cover - all three exist in a complete install
        raise ValueError(f"this commopt has no {class_name}; upgrade commopt")
    if ignored:
        warnings.warn(
            f"DeepSpeed {block['type']} config: these keys have no meaning in commopt and were "
            "ignored: " + "; ".join(ignored.values()),
            DeepSpeedConfigWarning,
            stacklevel=2,
        )
    return cls(params, backend=backend, **kwargs)


def to_deepspeed_config(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The DeepSpeed ``optimizer`` block equivalent to a commopt optimizer (first param group).

    The inverse of :func:`from_deepspeed_config` for the honoured keys (``freeze_step`` f is
    written as f + 1: DeepSpeed counts its initialising first step); the backend is written
    as ``comm_backend_name`` ``"mpi"`` for an MPI backend and ``"nccl"`` otherwise.
    """
    name = type(optimizer).__name__
    spec = next((s for s in SPECS.values() if s["class"] == name), None)
    if spec is None:
        raise TypeError(
            f"to_deepspeed_config needs a OnebitAdam, OnebitLamb or ZeroOneAdam, got {name}"
        )
    group = optimizer.param_groups[0]
    params: dict[str, Any] = {}
    for key in spec["honoured"]:
        if key in group:
            value = group[key]
        elif hasattr(optimizer, key):
            value = getattr(optimizer, key)
        else:
            continue
        if auto_settings(value) is not None:  # DeepSpeed has no automatic freeze
            decided = optimizer.global_state.get("auto_freeze_step")
            chosen = "" if decided is None else f" (the step it chose: {decided})"
            raise ValueError(
                f"to_deepspeed_config: {key}={value!r} is an automatic freeze, which DeepSpeed "
                f"does not have; construct the optimizer with an int {key}{chosen}"
            )
        if key in FREEZE_SHIFTED:
            value = value + 1  # DeepSpeed also counts its initialising step
        params[key] = list(value) if key == "betas" else value
    be = optimizer.requested_backend
    params["comm_backend_name"] = "mpi" if getattr(be, "name", None) == "mpi" else "nccl"
    params["cuda_aware"] = bool(getattr(be, "cuda_aware", False))
    ds_type = {"OnebitAdam": "OneBitAdam", "OnebitLamb": "OneBitLamb"}.get(name, name)
    return {"type": ds_type, "params": params}
