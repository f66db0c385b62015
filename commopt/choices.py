"""The words commopt's choice-valued options take, each defined once.

A ``Literal`` names the choices for the type checker, the signatures and the API reference;
the tuple beside it is derived from it (``typing.get_args``) for the checks at run time, so
the two cannot drift apart. The constructors, the configs, the exchanges and DiLoCo import
them from here; :func:`check_choice` words every refusal alike.
"""

from __future__ import annotations

from typing import Literal, TypeAlias, get_args

__all__ = [
    "COMPRESSIONS",
    "ERROR_FEEDBACKS",
    "OUTER_TOPOLOGIES",
    "SCALES",
    "STEP_GUARDS",
    "TOPOLOGIES",
    "TRUST_RATIOS",
    "Compression",
    "ErrorFeedback",
    "OuterTopology",
    "Scale",
    "StepGuard",
    "Topology",
    "TrustRatio",
    "check_choice",
]

#: how ranks are grouped for the exchange: one level (SPEC §1), full precision inside a node
#: and one bit across, or hierarchical where that is faster (docs/hierarchical.md)
Topology: TypeAlias = Literal["flat", "hierarchical", "auto"]
#: the workers' error feedback in the compressed exchange: SPEC §1's, or EControl's
ErrorFeedback: TypeAlias = Literal["classic", "econtrol"]
#: 1-bit LAMB's compression-stage trust ratio: SPEC §3's frozen c̄·f, LAMB's own, or the larger
TrustRatio: TypeAlias = Literal["frozen", "tracking", "max"]
#: where compression-stage steps are clamped to Adam's bound: tiny-variance elements, all, none
StepGuard: TypeAlias = Literal["tiny", True, False]
#: how DiLoCo's pseudo-gradient travels: the error-compensated 1-bit exchange, fp32, or bf16
Compression: TypeAlias = Literal["onebit", "none", "bf16"]
#: DiLoCo's topology: one level, or full precision every step inside a node (no "auto")
OuterTopology: TypeAlias = Literal["flat", "hierarchical"]
#: the unit DiLoCo's 1-bit exchange takes one scale for: each tensor, or each fragment
Scale: TypeAlias = Literal["tensor", "fragment"]

TOPOLOGIES: tuple[Topology, ...] = get_args(Topology)
ERROR_FEEDBACKS: tuple[ErrorFeedback, ...] = get_args(ErrorFeedback)
TRUST_RATIOS: tuple[TrustRatio, ...] = get_args(TrustRatio)
STEP_GUARDS: tuple[StepGuard, ...] = get_args(StepGuard)
COMPRESSIONS: tuple[Compression, ...] = get_args(Compression)  # (its order is agreed on)
OUTER_TOPOLOGIES: tuple[OuterTopology, ...] = get_args(OuterTopology)
SCALES: tuple[Scale, ...] = get_args(Scale)


def check_choice(name: str, value: object, choices: tuple[object, ...]) -> None:
    """``ValueError`` naming the option, the value and the choices unless ``value`` is one of
    them (by type and value: ``1`` is not ``True``, ``"auto"`` is not a str subclass's)."""
    if not any(type(value) is type(c) and value == c for c in choices):
        listed = ", ".join(map(repr, choices))
        raise ValueError(f"Invalid {name}: {value!r} (choose one of {listed})")
