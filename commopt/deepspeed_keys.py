"""What each key of a DeepSpeed 1-bit optimizer config means to commopt, and its JSON type.

The tables :mod:`commopt.deepspeed_compat` translates with: per optimizer type, the keys passed
on (*honoured*) and those with no meaning here (with what to do instead); the values refused;
the backends; the JSON type of every key (:func:`checked`); the engine-level keys of a whole
config; and how DeepSpeed counted steps (the note above ``FREEZE_SHIFTED``).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "BACKENDS",
    "COMMON_NO_MEANING",
    "ENGINE_KEYS",
    "FREEZE_SHIFTED",
    "REFUSED_VALUES",
    "SPECS",
    "checked",
]


# Keys every one of the three DeepSpeed optimizers took, and what commopt does with them.
_COMMON_HONOURED = ("lr", "betas", "eps", "weight_decay")
COMMON_NO_MEANING = {
    "max_grad_norm": "DeepSpeed's 1-bit optimizers stored it but never used it; clip gradients "
    "yourself before step() if you want clipping",
    "eps_inside_sqrt": "ignored by DeepSpeed's 1-bit optimizers too (eps is added outside the "
    "square root)",
    "amsgrad": "not supported by DeepSpeed's 1-bit optimizers either",
    "cuda_aware": "only means something with comm_backend_name 'mpi'",
    "comm_backend_name": "commopt chooses the backend (see the migration guide)",
}

SPECS: dict[str, dict[str, Any]] = {
    "onebitadam": {
        "class": "OnebitAdam",
        "honoured": (*_COMMON_HONOURED, "freeze_step", "bias_correction"),
        "no_meaning": {},
    },
    "onebitlamb": {
        "class": "OnebitLamb",
        "honoured": (
            *_COMMON_HONOURED,
            "freeze_step",
            "max_coeff",
            "min_coeff",
            "coeff_beta",
            "factor_max",
            "factor_min",
            "factor_threshold",
        ),
        "no_meaning": {
            "bias_correction": "1-bit LAMB uses m and v without bias correction, in DeepSpeed "
            "and in commopt",
        },
    },
    "zerooneadam": {
        "class": "ZeroOneAdam",
        "honoured": (
            *_COMMON_HONOURED,
            "var_freeze_step",
            "var_update_scaler",
            "local_step_scaler",
            "local_step_clipper",
        ),
        "no_meaning": {
            "bias_correction": "DeepSpeed's 0/1 Adam ignores it (no bias correction); commopt's "
            "ZeroOneAdam corrects m and v by default, an intended difference "
            "(docs/algorithms/zero_one_adam.md): pass bias_correction=False as an override "
            "for DeepSpeed's step",
        },
    },
}

# Values that would change the algorithm in a way commopt does not implement.
REFUSED_VALUES = {
    "amsgrad": (
        True,
        "AMSGrad is not supported by the 1-bit optimizers (DeepSpeed refused it too)",
    ),
    "eps_inside_sqrt": (True, "eps inside the square root is not implemented; use eps outside"),
}

BACKENDS = ("nccl", "mpi", "compressed", "gloo")

# The JSON type every key must have. JSON has no separate integer type, so a step count written
# as 1e5 (a float with an integer value) is accepted and converted; a string never is (the
# string "false" is truthy, and "1e-3" is not a number).
_REAL, _INT, _BOOL, _STR, _PAIR = (
    "a number",
    "an integer",
    "true or false",
    "a string",
    "a list of two numbers",
)
_KEY_TYPES = {
    "lr": _REAL,
    "betas": _PAIR,
    "eps": _REAL,
    "weight_decay": _REAL,
    "freeze_step": _INT,
    "bias_correction": _BOOL,
    "max_coeff": _REAL,
    "min_coeff": _REAL,
    "coeff_beta": _REAL,
    "factor_max": _REAL,
    "factor_min": _REAL,
    "factor_threshold": _REAL,
    "var_freeze_step": _INT,
    "var_update_scaler": _INT,
    "local_step_scaler": _INT,
    "local_step_clipper": _INT,
    "max_grad_norm": _REAL,
    "eps_inside_sqrt": _BOOL,
    "amsgrad": _BOOL,
    "cuda_aware": _BOOL,
    "comm_backend_name": _STR,
}

# Step counting. DeepSpeed's first ``step()`` only initialises state (no update) but is counted,
#: and its warmup ends after the step whose count reaches ``freeze_step``: DeepSpeed steps
#: 2 … max(F, 2) are warmup updates, i.e. max(F − 1, 1) of them (its freeze check is skipped on
#: the initialising step, so F = 0 and F = 1 give one warmup update, like F = 2). commopt uses
# every step, so ``freeze_step`` (1-bit Adam, 1-bit LAMB) translates to max(F − 1, 1) and back
#: to f + 1. 0/1 Adam freezes after the step whose count *exceeds* ``var_freeze_step``: DeepSpeed
#: steps 2 … V + 1 are phase A, V updates (at least 1), as commopt's ``var_freeze_step`` = V; so
#: that number is passed on as it is. What cannot be translated through the config: inside the
#: phases DeepSpeed's variance steps and syncs fall on its counts k ≡ 0 mod interval, which are
#: commopt's steps t = k − 1, so once an interval has doubled they come one step later than
#: commopt's (odd t instead of even). Same phase lengths and intervals, positions shifted by one.
FREEZE_SHIFTED = ("freeze_step",)  # F -> max(F - 1, 1); 0/1 Adam's V -> max(V, 1)


def _type_error(type_name: str, key: str, value: Any, expected: str) -> TypeError:
    hint = ""
    if isinstance(value, str):
        hint = " (a JSON string; write the value without quotes)"
    elif value is None:
        hint = " (null; give a value or leave the key out)"
    return TypeError(
        f"{type_name} param {key!r} = {value!r} is {type(value).__name__}{hint}; expected "
        f"{expected}"
    )


def checked(type_name: str, key: str, value: Any) -> Any:
    """``value`` if it has the JSON type ``key`` takes (integral floats → int), else TypeError."""
    expected = _KEY_TYPES[key]
    is_real = isinstance(value, (int, float)) and not isinstance(value, bool)
    for v in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(v, float) and not math.isfinite(v):  # JSON's Infinity, -Infinity, NaN
            raise ValueError(
                f"{type_name} param {key!r} = {value!r} is not a finite number; expected {expected}"
            )
    if expected == _REAL and is_real:
        return value
    if expected == _INT and is_real:
        if isinstance(value, int):
            return value
        if float(value).is_integer():
            return int(value)
    if expected == _BOOL and isinstance(value, bool):
        return value
    if expected == _STR and isinstance(value, str):
        return value
    if expected == _PAIR and isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ValueError(f"{type_name} param 'betas' must be two numbers, got {value!r}")
        for v in value:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise _type_error(type_name, key, value, expected)
        return (float(value[0]), float(value[1]))
    raise _type_error(type_name, key, value, expected)


# Top-level DeepSpeed keys that configured its engine, not the optimizer, with what to do.
ENGINE_KEYS = {
    "fp16": "use torch.amp.autocast with torch.amp.GradScaler and scaler.step(optimizer)",
    "bf16": "keep the model in bfloat16; commopt keeps fp32 optimizer state",
    "amp": "use torch.amp",
    "gradient_clipping": "call torch.nn.utils.clip_grad_norm_ before step() (on local gradients)",
    "gradient_accumulation_steps": "call backward() several times before step(); nothing is "
    "communicated until step()",
    "scheduler": "build a torch.optim.lr_scheduler on the returned optimizer",
    "zero_optimization": "commopt does not shard optimizer state (DeepSpeed's 1-bit optimizers "
    "did not support ZeRO either)",
    "prescale_gradients": "no effect: commopt averages (divides by n) itself",
    "gradient_predivide_factor": "no effect: commopt averages (divides by n) itself",
}
