"""Cross-rank agreement: conditions that can differ between ranks are decided by all of them.

A rank that raises or skips alone leaves the others waiting in the next collective, so every
condition that depends on a rank's own data (its model, its gradients) is reduced across ranks
first, in one small all-reduce, and all ranks act on the same verdict.

**Settings.** The ranks agree on the hyperparameters: a digest in every step's agreement, a
clear error.

Ranks built with different ``lr``, ``betas`` or ``weight_decay`` (a typo in one launcher's
arguments, a learning-rate scheduler stepped on a per-rank metric) take different steps from the
same averaged gradients, and their replicas drift apart without a word. The per-step agreement
already sends a few integers; one more pair carries a 63-bit digest of every setting — the
config and each param group's options — so that a difference is found at the first communicating
step after it appears, at the cost of hashing a few dozen short strings. Only then is the
difference located (:func:`check_same_settings`: two more small collectives) and raised, naming
the setting and every rank's value, on every rank alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any

import torch

from commopt.comm import Backend
from commopt.notices import warn_averaged_already
from commopt.sharding import local

__all__ = [
    "GradientAgreement",
    "GradientVerdict",
    "agree_on_gradients",
    "check_same_model",
    "check_same_settings",
    "describe_param",
    "first_difference",
    "item_key",
    "left_untouched",
    "model_key",
    "nonfinite_ranks",
    "settings_items",
    "settings_key",
]


def _text(value: Any) -> str:
    """A value as text that is equal exactly when the values are (floats: repr round-trips)."""
    if isinstance(value, torch.Tensor):
        return f"tensor({value.detach().cpu().tolist()!r})"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_text(v) for v in value) + ")"
    return repr(value)


def settings_items(config: Any, param_groups: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """(name, value as text) of every field of ``config`` and every option of every param group
    (its parameters aside), in a fixed order."""
    items = [(f.name, _text(getattr(config, f.name))) for f in dataclasses.fields(config)]
    for gi, group in enumerate(param_groups):
        for key in sorted(k for k in group if k != "params"):
            items.append((f"param_groups[{gi}][{key!r}]", _text(group[key])))
    return items


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def settings_key(items: Sequence[tuple[str, str]]) -> int:
    """63-bit digest of :func:`settings_items`."""
    return _hash("\n".join(f"{name}={value}" for name, value in items))


def item_key(name: str, value: str) -> int:
    """63-bit digest of one item (to locate a difference item by item)."""
    return _hash(f"{name}={value}")


def _fingerprint(p: torch.Tensor) -> int:
    """63-bit hash of a parameter's shape and dtype (identical on every rank for the same model)."""
    key = f"{tuple(p.shape)}|{p.dtype}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def model_key(params: Sequence[torch.Tensor]) -> int:
    """63-bit hash of the parameter count, shapes and dtypes, in order."""
    h = hashlib.blake2b(str(len(params)).encode(), digest_size=8)
    for p in params:
        h.update(_fingerprint(p).to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little") >> 1


def first_difference(backend: Backend, keys: Sequence[int]) -> tuple[int, int, int | None]:
    """Where the ranks' lists of 63-bit ``keys`` first differ (collective: two small
    all-reduces, the lengths, then the keys every rank has). Returns the largest and the
    smallest length, and the first index whose key differs on some rank, or the smallest length
    when only the lengths differ, or None when the lists are equal."""
    count = torch.tensor([len(keys), -len(keys)], dtype=torch.int64)
    backend.all_reduce(count, "max")
    largest, common = int(count[0]), int(-count[1])
    mine = torch.tensor(list(keys[:common]), dtype=torch.int64)
    both = torch.cat([mine, -mine])
    backend.all_reduce(both, "max")
    differ = (both[:common] != -both[common:]).nonzero()
    if len(differ):
        return largest, common, int(differ[0])
    return largest, common, (None if largest == common else common)


_VALUE_BYTES = 48  # how much of each rank's setting check_same_settings shows


def check_same_settings(backend: Backend, items: Sequence[tuple[str, str]], owner: str) -> None:
    """Raise the same ValueError on every rank unless every rank has the same ``items``
    (:func:`~commopt.optim._agreement.settings_items`), naming the first setting that differs
    and every rank's value (all-gathered); nothing when only the digest collided."""
    be = backend
    if be.world_size == 1:
        return
    largest, common, i = first_difference(be, [item_key(n, v) for n, v in items])
    if i is None:
        return
    name = items[i][0] if i < len(items) else f"setting #{i}"
    mine = (items[i][1] if i < len(items) else "(absent)").encode()[:_VALUE_BYTES]
    raw = torch.zeros(_VALUE_BYTES, dtype=torch.uint8)
    raw[: len(mine)] = torch.tensor(list(mine), dtype=torch.uint8)
    gathered = torch.empty(be.world_size * _VALUE_BYTES, dtype=torch.uint8)
    be.all_gather(gathered, raw)
    values = ", ".join(
        f"rank {r} {bytes(row[row != 0].tolist()).decode(errors='replace')}"
        for r, row in enumerate(gathered.view(be.world_size, _VALUE_BYTES))
    )
    what = (
        f"{name} differs between ranks: {values}"
        if largest == common
        else f"the param groups hold different options on different ranks (first at {name}: "
        f"{values})"
    )
    raise ValueError(
        f"{owner}: {what}. Every rank must build the optimizer with the same hyperparameters "
        "and change them alike (the same scheduler, stepped on a metric all ranks share): with "
        "different ones the replicas drift apart"
    )


def check_same_model(
    backend: Backend,
    params: Sequence[torch.Tensor],
    describe: Callable[[int], str],
    *,
    noun: str = "parameter",
    index: str = "flat index",
    prefix: str = "",
    advice: str = "Every rank must pass the same parameters, in the same order",
) -> None:
    """Raise the same ValueError on every rank unless all ranks pass the same tensors.

    Two small all-reduces: the counts, then the fingerprints of the tensors every rank has (the
    shortest list). When those agree but the counts differ, the first mismatch is the first
    tensor some rank lacks. ``describe(i)`` names the i-th tensor for the message; ``noun``,
    ``index``, ``prefix`` and ``advice`` word it for the caller (the optimizers,
    ``broadcast_parameters``).
    """
    be = backend
    if be.world_size == 1:
        return
    largest, common, i = first_difference(be, [_fingerprint(p) for p in params])
    if i is None:
        return
    if i < len(params):
        where = (
            f"{describe(i)} ({index} {i}), shape {tuple(params[i].shape)} {params[i].dtype} "
            f"on rank {be.rank}"
        )
    else:
        where = f"{index} {i}, which rank {be.rank} does not have"
    if largest != common:
        raise ValueError(
            f"{prefix}{noun} count differs between ranks: rank {be.rank} has {len(params)}, "
            f"the largest is {largest} and the smallest {common}; first mismatch at {where}. "
            f"{advice}"
        )
    raise ValueError(
        f"{prefix}{noun} shapes or dtypes differ between ranks; first mismatch at {where}. {advice}"
    )


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite, in one cheap pass in the common case.

    Any inf or NaN element makes the floating-point sum inf or NaN, so a finite sum proves the
    tensor finite; only a non-finite sum (which finite values can also give, by overflow) needs
    the exact elementwise check.
    """
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def nonfinite_ranks(backend: Backend, tensors: Sequence[torch.Tensor]) -> list[int]:
    """The ranks where some of ``tensors`` holds an inf or NaN (collective: one all-gather)."""
    bad = any(not _all_finite(t) for t in tensors)
    flags = torch.empty(backend.world_size, dtype=torch.int64)
    backend.all_gather(flags, torch.tensor([int(bad)], dtype=torch.int64))
    return [r for r, f in enumerate(flags.tolist()) if f]


def describe_param(param_groups: Sequence[dict[str, Any]], flat_index: int) -> str:
    """``param_groups[g]['params'][i]`` for a parameter's flat index (for the messages)."""
    for gi, g in enumerate(param_groups):
        if flat_index < len(g["params"]):
            return f"param_groups[{gi}]['params'][{flat_index}]"
        flat_index -= len(g["params"])
    raise IndexError(flat_index)


@dataclasses.dataclass(frozen=True)
class GradientVerdict:
    """What the ranks agreed on about this step's gradients."""

    same_model: bool
    """Every rank passed the same ``model_key`` (False: run :func:`check_same_model`)."""
    sparse_at: str | None
    """Where this rank found a sparse gradient, or a note that another rank did; None: none."""
    nonfinite: bool
    """Some rank (collective) or this rank (local) has an inf/NaN gradient."""
    without_grad: tuple[int, ...]
    """Flat indices of the parameters with no gradient on any rank (collective) or on this
    rank (local): they are skipped entirely, as torch.optim skips ``grad is None``."""
    redo: bool = False
    """Some rank asked for the step's early work to be redone (``redo=True``)."""
    identical: bool = False
    """Asked for (``digest=True``) on several ranks: every rank's gradients are bit for bit
    the same (a digest of their bits agrees), which is what DDP leaves after its own average."""
    same_settings: bool = True
    """Every rank passed the same hyperparameter digest (False: locate the difference)."""


_HEAD = 9  # flags before the per-parameter ones in agree_on_gradients


def gradient_digest(params: Sequence[torch.Tensor]) -> int:
    """A 62-bit digest of the bits of every gradient, in order (0 if there is none): equal
    digests on two ranks mean, but for a collision, bit-identical gradients. One integer sum
    per gradient over its bytes read as int64 words (wrapping; the few trailing bytes as int64
    values): a single pass at memory speed, 27× faster than summing 32-bit words into int64."""
    h = 0
    for p in params:
        g = p.grad
        if g is None or g.is_sparse:
            continue
        g = local(g)  # (this rank's shard of a sharded gradient)
        if g.numel() == 0:
            continue
        h = (h * 1_000_003 + _word_sum(g.detach()) + 1) % (1 << 62)
    return h


def _word_sum(t: torch.Tensor) -> int:
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    try:
        words = raw[:whole].view(torch.int64)
    except RuntimeError:  # a view at an offset that is no multiple of 8 bytes: copy it
        words = raw[:whole].clone().view(torch.int64)
    return int(words.sum()) + int(raw[whole:].sum(dtype=torch.int64))


def agree_on_gradients(
    backend: Backend,
    params: Sequence[torch.Tensor],
    describe: Callable[[int], str],
    collective: bool,
    key: int,
    width: int,
    digest: bool = False,
    redo: bool = False,
    settings: int = 0,
) -> GradientVerdict:
    """Agree in one all-reduce (max) of 9 + ``width`` integers on: the model (``key``, from
    :func:`model_key`), the hyperparameters (``settings``, from
    :func:`~commopt.optim._agreement.settings_key`), sparse gradients, non-finite gradients, and
    which of the first
    ``width`` parameters have a gradient somewhere. ``width`` is the parameter count all ranks
    last agreed on, so the message has the same size on every rank even when one rank has
    added a param group since; the caller re-checks the model when ``same_model`` is False or
    its count is not ``width``. With ``collective=False`` (a purely local step) nothing is sent
    and the verdict is this rank's own. ``digest`` (the same on every rank): also whether the
    gradients are bit-identical on every rank (:func:`gradient_digest`, one pass over them).
    ``redo``: this rank wants the step's early work redone (any rank's wish holds for all)."""
    sparse_at = None
    nonfinite = False
    flags = torch.zeros(_HEAD + width, dtype=torch.int64)
    for i, p in enumerate(params):
        g = p.grad
        if g is None:
            continue
        if i < width:
            flags[_HEAD + i] = 1
        if g.is_sparse:
            sparse_at = sparse_at or describe(i)
        elif not nonfinite and not _all_finite(local(g)):
            nonfinite = True
    flags[0], flags[1], flags[2], flags[3] = sparse_at is not None, nonfinite, key, -key
    several = collective and backend.world_size > 1
    h = gradient_digest(params) if digest and several else 0
    flags[4], flags[5], flags[6] = h, -h, int(redo)
    flags[7], flags[8] = settings, -settings
    if several:
        backend.all_reduce(flags, "max")
    if flags[0] and sparse_at is None:
        sparse_at = f"a parameter on another rank (not rank {backend.rank})"
    without = (flags[_HEAD:] == 0).nonzero().squeeze(1).tolist()
    same = bool(flags[2] == -flags[3])
    identical = bool(h != 0 and flags[4] == -flags[5])
    return GradientVerdict(
        same,
        sparse_at,
        bool(flags[1]),
        tuple(int(i) for i in without),
        bool(flags[6]),
        identical,
        same_settings=bool(flags[7] == -flags[8]),
    )


@contextlib.contextmanager
def left_untouched(
    params: Sequence[torch.Tensor], param_state: MutableMapping[torch.Tensor, dict[str, Any]]
) -> Iterator[None]:
    """Inside, a step may change anything; on exit ``params`` and every state tensor of theirs
    are as they were. For the parameters agreed to have no gradient: torch.optim skips
    ``grad is None`` (no decay, no momentum), and so do we. A master copy first made during the
    step follows the parameter. The exchange's error buffers are per bucket and not restored."""
    if not params:
        yield
        return
    saved = [
        (
            p,
            p.detach().clone(),
            {k: v.clone() for k, v in param_state[p].items() if torch.is_tensor(v)},
        )
        for p in params
    ]
    yield
    for p, value, state in saved:
        p.copy_(value)
        for key, now in param_state[p].items():
            if key in state and torch.is_tensor(now):
                now.copy_(state[key])
            elif key == "master":
                now.copy_(value)


class GradientAgreement:
    """One optimizer's agreement across ranks: the model checked once (again when a param group
    joined), then one gradient verdict per step.

    Owns the parameter count all ranks last agreed on (None: check the model at the next step)
    and this rank's :func:`model_key`, kept for as long as the parameter list is the same.

    Args:
        name: the optimizer's class name, for the messages.
        config: the optimizer's config, whose fields the ranks agree on with the param groups'
            options (:mod:`commopt.optim._agreement`).
    """

    def __init__(self, name: str, config: Any = None) -> None:
        self.name = name
        self.config = config
        self.agreed_count: int | None = None
        self._key: tuple[tuple[int, ...], int] | None = None  # (param ids, model_key)
        #: communicating steps that still check whether the gradients are already identical
        #: on every rank (DDP without commopt's hook averaged them); 0 once that was found
        self.ddp_checks_left = 2

    def check_model(
        self,
        backend: Backend,
        params: Sequence[torch.Tensor],
        param_groups: Sequence[dict[str, Any]],
    ) -> None:
        """:func:`check_same_model`, unless the ranks have agreed since the last :meth:`forget`."""
        if self.agreed_count is None:
            check_same_model(backend, params, functools.partial(describe_param, param_groups))
            self.agreed_count = len(params)

    def forget(self) -> None:
        """Check the model again at the next step (state was loaded)."""
        self.agreed_count = None

    def verdict(
        self,
        backend: Backend,
        params: Sequence[torch.Tensor],
        param_groups: Sequence[dict[str, Any]],
        collective: bool,
        may_be_averaged: bool = False,
        redo: bool = False,
    ) -> GradientVerdict:
        """:func:`agree_on_gradients`; a model that changed on some rank is checked again (which
        raises on every rank alike, or every rank added the same group: agree again). With
        ``may_be_averaged`` (no early work), the first communicating steps also compare the
        gradients' digests, and warn once when they were already averaged.

        Raises:
            RuntimeError: some rank has a sparse gradient (on every rank alike).
        """
        digest = may_be_averaged and collective and self.ddp_checks_left > 0
        describe = functools.partial(describe_param, param_groups)
        ids = tuple(id(p) for p in params)
        if self._key is None or self._key[0] != ids:
            self._key = (ids, model_key(params))
        key = self._key[1]
        width = self.agreed_count
        items = [] if self.config is None else settings_items(self.config, param_groups)
        settings = settings_key(items) if collective and backend.world_size > 1 else 0
        agree = functools.partial(agree_on_gradients, backend, params, describe, collective, key)
        verdict = agree(width, digest, redo, settings)
        if collective and (not verdict.same_model or len(params) != self.agreed_count):
            check_same_model(backend, params, describe)  # raises on every rank
            self.agreed_count = len(params)  # every rank added the same group: agree again
            verdict = agree(self.agreed_count, digest, redo, settings)
        if collective and not verdict.same_settings:
            check_same_settings(backend, items, self.name)  # raises on every rank
        if verdict.sparse_at is not None:
            raise RuntimeError(
                f"{self.name} does not support sparse gradients (found at "
                f"{verdict.sparse_at}); use dense gradients, e.g. nn.Embedding(sparse=False)"
            )
        if digest:
            self.ddp_checks_left = 0 if verdict.identical else self.ddp_checks_left - 1
            if verdict.identical:
                warn_averaged_already(self.name, backend.rank)
        return verdict
