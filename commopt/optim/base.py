"""What every commopt optimizer shares: backend, flat buckets, per-rank error buffers, checks.

The algorithms themselves live one per file (``onebit_adam.py`` …) and read like their papers;
this module holds the plumbing they have in common, so none of them repeats it:

- the backend is resolved at the first ``step()`` (``backend=None`` → SPEC §5), never saved;
- at the first step one cheap fingerprint (parameter count, then shapes and dtypes) is
  all-reduced so ranks with different models fail together, naming the first mismatch;
- every step starts with one tiny all-reduce of flags (sparse gradient, non-finite gradient)
  so all ranks raise or skip alike instead of one raising while the rest hang;
- optimizer state lives in flat fp32 buffers per bucket; ``state[p]`` holds views into them,
  so ``state_dict()`` looks like torch's;
- the worker/server error buffers belong to this rank and are saved in ``state_dict()`` under
  ``"commopt"`` together with the world size, and restored on resume at the same world size.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch

import commopt
from commopt.buckets import DEFAULT_BUCKET_NUMEL, Bucket, build_buckets
from commopt.comm import Backend, CommStats, resolve_backend
from commopt.compressed import compressed_allreduce_and_scale, padded_size

__all__ = [
    "CompressedOptimizer",
    "check_adam_arguments",
    "check_beta",
    "check_nonnegative",
    "check_step_count",
]

logger = logging.getLogger(__name__)


def check_nonnegative(name: str, value: float) -> None:
    if not value >= 0.0:  # also rejects NaN
        raise ValueError(f"Invalid {name}: {value} (must be >= 0)")


def check_beta(index: int, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"Invalid beta parameter at index {index}: {value} (must be in [0, 1))")


def check_adam_arguments(
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> None:
    """The checks every Adam-family constructor makes, with torch.optim's wording."""
    check_nonnegative("learning rate", lr)
    check_nonnegative("epsilon value", eps)
    check_nonnegative("weight_decay value", weight_decay)
    check_beta(0, betas[0])
    check_beta(1, betas[1])


def check_step_count(name: str, value: int, minimum: int, why: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Invalid {name}: {value!r} (must be an int)")
    if value < minimum:
        raise ValueError(f"Invalid {name}: {value} (must be >= {minimum}: {why})")


def _fingerprint(p: torch.Tensor) -> int:
    """63-bit hash of a parameter's shape and dtype (identical on every rank for the same model)."""
    key = f"{tuple(p.shape)}|{p.dtype}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


_INTERNAL_DIRS = tuple(
    str(Path(module.__file__).resolve().parent) + os.sep for module in (commopt, torch)
)


def _warn_at_caller(message: str) -> None:
    """``warnings.warn`` attributed to the first frame outside commopt and torch: the line of
    the user's code that called ``step()``, not an internal helper or torch's no_grad wrapper."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite, in one cheap pass in the common case.

    Any inf or NaN element makes the floating-point sum inf or NaN, so a finite sum proves the
    tensor finite; only a non-finite sum (which finite values can also give, by overflow) needs
    the exact elementwise check.
    """
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


class CompressedOptimizer(torch.optim.Optimizer):
    """Base class: subclasses implement ``_step(t)`` and name their flat state keys."""

    #: per-parameter fp32 state kept in flat bucket buffers, identical on all ranks
    _flat_keys: tuple[str, ...] = ()
    #: like ``_flat_keys`` but allocated only when the algorithm first asks (``_flat_buffer``)
    _lazy_flat_keys: tuple[str, ...] = ()
    #: one fp32 scalar per parameter tensor (key → initial value), kept in one flat buffer per
    #: bucket; ``state[p][key]`` is a 0-d view into it
    _scalar_keys: ClassVar[dict[str, float]] = {}
    #: compute ``comm_stats()["compression_error"]`` (one dot product per compressed call)
    track_compression_error: bool = True
    _last_compression: tuple[torch.Tensor, torch.Tensor] | None = None
    #: None: one bucket per device (a single fused compressed call); else the bucket size cap
    _bucket_numel: int | None = DEFAULT_BUCKET_NUMEL

    def __init__(self, params: Any, defaults: dict[str, Any], backend: Backend | None) -> None:
        super().__init__(params, defaults)
        for group in self.param_groups:
            self._check_mask(group)
        self._backend_arg = backend
        self._backend: Backend | None = None
        self._buckets: list[Bucket] | None = None
        self._flat: list[dict[str, torch.Tensor]] = []
        self._scalars: list[dict[str, torch.Tensor]] = []
        self._errors: list[dict[str, torch.Tensor]] = []
        self._pending_comm: dict[str, Any] | None = None
        self._checked = False
        self.global_state: dict[str, Any] = {"step": 0, "skipped_steps": 0}
        self._compressed_rounds = 0
        self._full_rounds = 0
        self._zero_variance: dict[int, torch.Tensor | None] = {}
        self._scratch: dict[tuple[int, str], torch.Tensor] = {}
        self._denominator_keys: dict[int, tuple] = {}  # what the kept denominator was built from
        self._warned_zero_variance = False

    # -- hooks for subclasses -----------------------------------------------------------------
    def _step(self, step: int) -> None:  # pragma: no cover - every subclass defines it
        """Run step ``step`` (counted from 1) of the algorithm; flags were already agreed."""
        raise NotImplementedError(f"{type(self).__name__} must define _step")

    def _communicates(self, step: int) -> bool:
        """Whether step ``step`` talks to other ranks. A purely local step (False) agrees on
        nothing: its gradient flags are checked on this rank only (see ``_skip_local``)."""
        del step
        return True

    def _skip_local(self, step: int) -> None:  # pragma: no cover - only with local steps
        """Local step ``step`` had a non-finite gradient on this rank: drop this rank's update
        but advance whatever schedule the ranks share, so they stay in lock step."""
        raise NotImplementedError(f"{type(self).__name__} must define _skip_local")

    @staticmethod
    def _check_mask(group: dict[str, Any]) -> None:
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

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._check_mask(self.param_groups[-1])
        self._buckets = None  # re-layout at the next step

    # -- backend and layout -------------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        if self._backend is None:
            self._backend = resolve_backend(self._backend_arg)
        return self._backend

    def comm_stats(self) -> dict[str, Any]:
        """Traffic of this optimizer's backend plus full-precision vs compressed rounds.

        ``compression_error`` is ‖e‖/‖c‖ for this rank's last compressed call: c = x + e_old is
        the error-compensated buffer this rank compressed and e = c − s·sgn(c) what its 1-bit
        approximation missed (worker side only; the server stage and the error of the average
        itself would need another all-reduce). It lies in [0, √2): about 0.6 for Gaussian-like
        values, lower when magnitudes are uniform; a steady rise means the error feedback is
        no longer keeping up. ``None`` before the first compressed call.
        """
        stats: CommStats = self.backend.stats
        return {
            "calls": stats.calls,
            "bytes_sent": stats.bytes_sent,
            # modelled per collective (comm/base.py); these collectives are symmetric under it
            "bytes_received": stats.bytes_sent,
            "calls_by_op": dict(stats.calls_by_op),
            "bytes_by_op": dict(stats.bytes_by_op),
            "full_precision_rounds": self._full_rounds,
            "compressed_rounds": self._compressed_rounds,
            "skipped_steps": self.global_state["skipped_steps"],
            "compression_error": self._compression_error(),
        }

    def _compression_error(self) -> float | None:
        """‖e‖/‖c‖ of this rank's last compressed call (worker side; None before any)."""
        if self._last_compression is None:
            return None
        e_sq, c_sq = (float(v) for v in self._last_compression)
        return (max(e_sq, 0.0) / c_sq) ** 0.5 if c_sq > 0 else 0.0

    def _check_same_model(self) -> None:
        """All ranks must hold the same parameters: agree once, name the first mismatch.

        The parameters every rank has (the shortest list) are compared by fingerprint; when
        they agree but the counts differ, the first mismatch is the first parameter that some
        rank lacks.
        """
        be = self.backend
        if be.world_size == 1:
            return
        params = [p for g in self.param_groups for p in g["params"]]
        count = torch.tensor([len(params), -len(params)], dtype=torch.int64)
        be.all_reduce(count, "max")
        largest, common = int(count[0]), int(-count[1])
        prints = torch.tensor([_fingerprint(p) for p in params[:common]], dtype=torch.int64)
        both = torch.cat([prints, -prints])
        be.all_reduce(both, "max")
        mismatch = (both[:common] != -both[common:]).nonzero()
        if not len(mismatch) and largest == common:
            return
        i = int(mismatch[0]) if len(mismatch) else common
        if i < len(params):
            gi, pi = self._locate(i)
            where = (
                f"param_groups[{gi}]['params'][{pi}] (flat index {i}), shape "
                f"{tuple(params[i].shape)} {params[i].dtype} on rank {be.rank}"
            )
        else:
            where = f"flat index {i}, which rank {be.rank} does not have"
        if largest != common:
            raise ValueError(
                f"parameter count differs between ranks: rank {be.rank} has {len(params)}, "
                f"the largest is {largest} and the smallest {common}; first mismatch at {where}. "
                "Every rank must pass the same parameters, in the same order"
            )
        raise ValueError(
            f"parameter shapes or dtypes differ between ranks; first mismatch at {where}. "
            "Every rank must pass the same parameters, in the same order"
        )

    def _locate(self, flat_index: int) -> tuple[int, int]:
        for gi, g in enumerate(self.param_groups):
            if flat_index < len(g["params"]):
                return gi, flat_index
            flat_index -= len(g["params"])
        raise IndexError(flat_index)

    def _layout(self) -> None:
        """Build buckets and flat state; move any loaded per-parameter state into them."""
        n = self.backend.world_size
        self._buckets = build_buckets(self.param_groups, self._bucket_numel)
        self._flat, self._scalars, self._errors = [], [], []
        self._scratch.clear()
        self._denominator_keys.clear()
        self._variance_changed()
        for bucket in self._buckets:
            flat = {key: self._new_flat(bucket, key) for key in self._flat_keys}
            for key in self._lazy_flat_keys:
                if any(key in self.state[p] for p in bucket.params):
                    flat[key] = self._new_flat(bucket, key)
            self._flat.append(flat)
            scalars = {}
            for key, initial in self._scalar_keys.items():
                buf = torch.full((len(bucket.params),), initial, device=bucket.device)
                for i, p in enumerate(bucket.params):
                    old = self.state[p].get(key)
                    if old is not None:
                        buf[i].copy_(old)
                    self.state[p][key] = buf[i]
                scalars[key] = buf
            self._scalars.append(scalars)
            padded = padded_size(bucket.numel, n)
            self._errors.append(
                {
                    "worker_error": torch.zeros(padded, device=bucket.device),
                    "server_error": torch.zeros(padded // n, device=bucket.device),
                }
            )
        if self._pending_comm is not None:
            self._restore_errors(self._pending_comm)
            self._pending_comm = None

    def _new_flat(self, bucket: Bucket, key: str) -> torch.Tensor:
        """A flat fp32 buffer for ``key`` whose views become ``state[p][key]`` (old values kept)."""
        buf = bucket.new_buffer()
        for p, view in zip(bucket.params, bucket.views(buf), strict=True):
            old = self.state[p].get(key)
            if old is not None:
                view.copy_(old)
            self.state[p][key] = view
        return buf

    def _scratch_buffer(self, bucket_index: int, name: str) -> torch.Tensor:
        """A flat fp32 work buffer of the bucket's size (contents undefined; not state).

        On CPU it is kept from step to step: allocated afresh, a buffer of tens of MB comes
        from the OS as new pages, zeroed on first touch, which costs more than the pass that
        fills it (a 100 MB gradient copy measured 71 ms into a fresh buffer, 22 ms into a kept
        one, on this project's CPU). On other devices it is allocated per call: CUDA's caching
        allocator makes that cheap, and gives the memory to activations between steps, where a
        kept buffer would stay resident through forward and backward.
        """
        bucket = (self._buckets or [])[bucket_index]
        if bucket.device.type != "cpu":
            return torch.empty(bucket.numel, device=bucket.device)
        key = (bucket_index, name)
        buf = self._scratch.get(key)
        if buf is None:
            buf = self._scratch[key] = torch.empty(bucket.numel, device=bucket.device)
        return buf

    def _flat_buffer(self, bucket_index: int, key: str) -> torch.Tensor:
        """The flat buffer of a lazy key, created (zeros) the first time it is asked for."""
        flat = self._flat[bucket_index]
        if key not in flat:
            flat[key] = self._new_flat((self._buckets or [])[bucket_index], key)
        return flat[key]

    def _reset_errors(self) -> None:
        """Zero every worker and server error buffer of this rank."""
        for errors in self._errors:
            for buf in errors.values():
                buf.zero_()

    def _restore_errors(self, comm: dict[str, Any]) -> None:
        be = self.backend
        saved = comm.get("buckets", [])
        if not saved:  # saved before the first step, or reset on purpose: errors stay zero
            return
        if comm.get("world_size") != be.world_size:
            warnings.warn(
                f"checkpoint was saved at world size {comm.get('world_size')}, now "
                f"{be.world_size}: "
                "the per-rank error buffers are reset to zero (everything else is restored)",
                stacklevel=3,
            )
            return
        if comm.get("rank") != be.rank:
            warnings.warn(
                f"error buffers saved by rank {comm.get('rank')} are loaded on rank {be.rank}",
                stacklevel=3,
            )
        if [b["numel"] for b in saved] != [b.numel for b in self._buckets or []]:
            raise ValueError(
                "saved bucket layout does not match this optimizer's parameters: saved "
                f"{[b['numel'] for b in saved]} elements per bucket, have "
                f"{[b.numel for b in self._buckets or []]}"
            )
        for errors, entry in zip(self._errors, saved, strict=True):
            for key in ("worker_error", "server_error"):
                errors[key].copy_(entry[key])

    # -- per-step helpers ---------------------------------------------------------------------
    def _preflight(self, collective: bool = True) -> bool:
        """Agree across ranks on sparse and non-finite gradients. True: go on; False: skip.

        With ``collective=False`` (a purely local step) nothing is communicated: the flags are
        this rank's own, and False means only this rank's update is to be dropped.
        """
        be = self.backend
        sparse_where = None
        nonfinite = False
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    sparse_where = sparse_where or f"param_groups[{gi}]['params'][{pi}]"
                elif not nonfinite and not _all_finite(g):
                    nonfinite = True
        flags = torch.tensor([sparse_where is not None, nonfinite], dtype=torch.int64)
        if collective and be.world_size > 1:
            be.all_reduce(flags, "max")
        if flags[0]:
            where = sparse_where or f"a parameter on another rank (not rank {be.rank})"
            raise RuntimeError(
                f"{type(self).__name__} does not support sparse gradients (found at {where}); "
                "use dense gradients, e.g. nn.Embedding(sparse=False)"
            )
        if flags[1]:
            self.global_state["skipped_steps"] += 1
            if collective:
                what = (
                    "non-finite gradient on at least one rank at step "
                    f"{self.global_state['step'] + 1}; the step is skipped on every rank and no "
                    "state changed"
                )
            else:
                what = (
                    f"non-finite gradient on rank {be.rank} at local step "
                    f"{self.global_state['step'] + 1}; this rank's local update is dropped (the "
                    "step communicates nothing) and the next sync reconciles the replicas"
                )
            _warn_at_caller(f"{type(self).__name__}: {what}")
            return False
        return True

    def _gather_grads(self, bucket: Bucket, out: torch.Tensor) -> torch.Tensor:
        """Copy this rank's gradients into ``out`` (flat fp32); a missing gradient counts as 0."""
        for p, view in zip(bucket.params, bucket.views(out), strict=True):
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad)
        return out

    def _momentum_from_local_grads(self, bucket: Bucket, m: torch.Tensor) -> None:
        """m ← β1·m + (1−β1)·g (as ``lerp``, like torch.optim.Adam) with this rank's own
        gradients, read where they are (no copy into a flat buffer first); a missing gradient
        counts as 0."""
        for seg in bucket.segments:
            beta1 = self.param_groups[seg.group]["betas"][0]
            views, grads, without = [], [], []
            for view, p in zip(seg.views(m), seg.params, strict=True):
                if p.grad is None:
                    without.append(view)
                else:  # lerp wants one dtype: bf16/fp16 gradients are widened (exactly)
                    views.append(view)
                    grads.append(p.grad.to(view.dtype))
            if views:
                torch._foreach_lerp_(views, grads, 1 - beta1)
            if without:
                torch._foreach_mul_(without, beta1)

    def _average(self, flat: torch.Tensor) -> torch.Tensor:
        """Full-precision average across ranks (warmup and variance steps)."""
        if self.backend.world_size > 1:
            self.backend.all_reduce(flat, "avg")
            self._full_rounds += 1
        return flat

    def _compress(self, bucket_index: int, flat: torch.Tensor) -> torch.Tensor:
        """Error-compensated 1-bit average of ``flat`` across ranks, written back into it."""
        if self.backend.world_size > 1:
            errors = self._errors[bucket_index]
            e = errors["worker_error"]
            _, s = compressed_allreduce_and_scale(
                flat, e, errors["server_error"], self.backend, out=flat
            )
            if self.track_compression_error and s is not None:
                # e is now c − s·sgn(c); ‖c‖² = N·s² by the definition of s (s = ‖c‖/√N)
                self._last_compression = (e.dot(e), s.double().square() * e.numel())
            self._compressed_rounds += 1
        return flat

    def _mask(self, bucket_index: int, flat: torch.Tensor) -> None:
        """flat ← flat ⊙ exp_avg_mask ⊙ [v ≠ 0], on what a compressed exchange returned.

        ``exp_avg_mask`` is the user's, as in SPEC §2. [v ≠ 0] is commopt's own guard (see
        ``_discard_zero_variance``).
        """
        bucket = (self._buckets or [])[bucket_index]
        for seg in bucket.segments:
            mask = self.param_groups[seg.group].get("exp_avg_mask")
            if mask is None:
                continue
            start = seg.start
            for p in seg.params:
                view = flat[start : start + p.numel()].view(p.shape)
                view.mul_(mask.to(device=view.device, dtype=view.dtype))
                start += p.numel()
        self._discard_zero_variance(bucket_index, flat)

    def _discard_zero_variance(self, bucket_index: int, flat: torch.Tensor) -> None:
        """flat ← 0 wherever the variance v is exactly 0 (an intended difference from SPEC).

        An element whose v is 0 had a zero averaged gradient on every full-precision step so
        far: an embedding row never looked up, a dead ReLU unit. The 1-bit code has no zero, so
        the exchange hands it ±scale all the same, and its step m/(√v + ε) would be divided by
        ε alone, ~1/ε times too large (the loss of a byte-level LM went to NaN this way). Such
        elements are treated as masked: their momentum stays 0 and they do not move while v
        is 0. v is identical on every rank, so replicas stay identical. The elements are found
        once per value of v (``_variance_changed`` forgets them) and kept as indices: usually
        few, and an indexed fill costs nothing next to ``masked_fill_`` with a boolean mask of
        the whole bucket (47 ms for 25M elements on this project's CPU, every step).
        """
        if bucket_index not in self._zero_variance:
            v = self._flat[bucket_index]["exp_avg_sq"]
            where = (v == 0).nonzero().squeeze(1)
            found = where.numel()
            self._zero_variance[bucket_index] = where if found else None
            if found and not self._warned_zero_variance and self.backend.rank == 0:
                self._warned_zero_variance = True
                _warn_at_caller(
                    f"{type(self).__name__}: {found} of {v.numel()} elements have zero variance "
                    "(a zero averaged gradient on every full-precision step so far); they do "
                    "not move while it is zero, as if exp_avg_mask were 0 there, because their "
                    "step m/(sqrt(v) + eps) would be divided by eps alone"
                )
        where = self._zero_variance[bucket_index]
        if where is not None:
            flat.index_fill_(0, where, 0.0)

    def _variance_changed(self, bucket_index: int | None = None) -> None:
        """v of one bucket (all when ``None``) was updated: what is derived from it (the
        zero-variance indices, the Adam denominator) is recomputed when next needed."""
        if bucket_index is None:
            self._zero_variance.clear()
            self._denominator_keys.clear()
        else:
            self._zero_variance.pop(bucket_index, None)
            self._denominator_keys.pop(bucket_index, None)

    def _denominator(self, bucket_index: int, bias_sqrt: list[float]) -> torch.Tensor:
        """d = √v / b + ε, elementwise over the bucket: the Adam denominator (read-only).

        b = ``bias_sqrt[i]`` and ε the group's eps for the i-th segment. d lives in a
        ``_scratch_buffer``: kept on CPU, where it is rebuilt only when v changes
        (``_variance_changed``) or b or ε do (in the compression stages v is frozen, and
        rebuilding d would be three passes over the model every step); computed per call into a
        fresh buffer on other devices.
        """
        bucket = (self._buckets or [])[bucket_index]
        key = tuple(
            (b, self.param_groups[seg.group]["eps"])
            for seg, b in zip(bucket.segments, bias_sqrt, strict=True)
        )
        d = self._scratch_buffer(bucket_index, "denominator")
        if self._denominator_keys.get(bucket_index) == key:
            return d
        v = self._flat[bucket_index]["exp_avg_sq"]
        for seg, (b, eps) in zip(bucket.segments, key, strict=True):
            sl = slice(seg.start, seg.stop)
            torch.sqrt(v[sl], out=d[sl])
            if b != 1.0:  # x / 1 == x exactly: skipping it changes no bit
                d[sl].div_(b)
            d[sl].add_(eps)
        if bucket.device.type == "cpu":  # elsewhere the buffer is not kept
            self._denominator_keys[bucket_index] = key
        return d

    @staticmethod
    def _gather_params(bucket: Bucket, out: torch.Tensor) -> torch.Tensor:
        """Copy the parameters into ``out`` (flat fp32)."""
        for p, view in zip(bucket.params, bucket.views(out), strict=True):
            view.copy_(p)
        return out

    @staticmethod
    def _set_params(bucket: Bucket, flat: torch.Tensor) -> None:
        """p ← flat (fp32), cast to each parameter's dtype."""
        for p, view in zip(bucket.params, bucket.views(flat), strict=True):
            p.copy_(view)

    @staticmethod
    def _add_to_params(bucket: Bucket, update: torch.Tensor) -> None:
        """p ← p + update (flat fp32), cast to each parameter's dtype."""
        for p, u in zip(bucket.params, bucket.views(update), strict=True):
            p.add_(u if p.dtype == u.dtype else u.to(p.dtype))

    # -- torch.optim.Optimizer API ------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._checked:
            self._check_same_model()
            self._checked = True
        if self._buckets is None:
            self._layout()
        step = self.global_state["step"] + 1
        collective = self._communicates(step)
        if not self._preflight(collective):
            if not collective:  # a local step: the shared schedule still moves on
                self.global_state["step"] = step
                with self._master_weights():
                    self._skip_local(step)
            return loss
        self._unscale_grads()
        self.global_state["step"] = step
        with self._master_weights():
            self._step(step)
        return loss

    # -- mixed precision ----------------------------------------------------------------------
    #: ``GradScaler.step(opt)`` calls ``step()`` on every rank, with ``grad_scale`` set, instead
    #: of skipping it on the ranks that found an inf locally (which would leave the others
    #: waiting in the step's all-reduce): the agreement on non-finite gradients is ours.
    _step_supports_amp_scaling = True

    def _unscale_grads(self) -> None:
        """Under ``GradScaler.step(opt)``: g ← g / scale, in place (as ``scaler.unscale_``).

        GradScaler sets ``self.grad_scale`` only when it has not unscaled the gradients itself
        (a user's ``scaler.unscale_(opt)`` for clipping leaves it unset).
        """
        scale = getattr(self, "grad_scale", None)
        if scale is None:
            return
        inv = scale.double().reciprocal().float() if torch.is_tensor(scale) else 1.0 / scale
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(inv.to(p.grad.device) if torch.is_tensor(inv) else inv)

    @contextlib.contextmanager
    def _master_weights(self) -> Iterator[None]:
        """Inside: every non-fp32 parameter's data is its fp32 master copy (flat state
        ``"master"``), so the algorithm runs in fp32; on exit the parameter is rounded from it.

        The master copy starts as the parameter's value and is saved in ``state_dict()``, so a
        resumed run continues from the unrounded weights.
        """
        swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
        for bi, bucket in enumerate(self._buckets or []):
            if all(p.dtype == torch.float32 for p in bucket.params):
                continue
            fresh = {id(p) for p in bucket.params if "master" not in self.state[p]}
            master = self._flat_buffer(bi, "master")
            for p, view in zip(bucket.params, bucket.views(master), strict=True):
                if p.dtype == torch.float32:
                    self.state[p].pop("master", None)  # fp32 parameters are their own master
                    continue
                if id(p) in fresh:
                    view.copy_(p)
                swapped.append((p, p.data))
                p.data = view
        try:
            yield
        finally:
            for p, low in swapped:
                low.copy_(p.data)
                p.data = low

    def state_dict(self) -> dict[str, Any]:
        """torch's ``state_dict`` plus ``"commopt"``: global state and this rank's error buffers."""
        sd = super().state_dict()
        be = self.backend
        sd["commopt"] = {
            "global": copy.deepcopy(self.global_state),
            "world_size": be.world_size,
            "rank": be.rank,
            "buckets": [
                {"numel": b.numel, **{k: v.clone() for k, v in e.items()}}
                for b, e in zip(self._buckets or [], self._errors, strict=True)
            ],
        }
        if self._pending_comm is not None and not sd["commopt"]["buckets"]:
            sd["commopt"]["buckets"] = self._pending_comm.get("buckets", [])
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        comm = state_dict.pop("commopt", None)
        super().load_state_dict(state_dict)
        self._keep_state_dtypes(state_dict)
        if comm is not None:
            self.global_state = copy.deepcopy(comm["global"])
            self._pending_comm = comm
        self._buckets = None  # rebuild flat buffers from the loaded per-parameter state
        self._checked = False

    def _keep_state_dtypes(self, state_dict: dict[str, Any]) -> None:
        """Undo torch's cast of loaded state to the parameter's dtype: the optimizer state is
        fp32 even for bf16/fp16 parameters, and a round trip through bf16 would lose bits."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for saved_id, p in zip(saved_ids, params, strict=True):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if (
                    isinstance(value, torch.Tensor)
                    and value.is_floating_point()
                    and value.dtype != p.dtype
                    and key != "step"
                ):
                    self.state[p][key] = value.to(device=p.device, copy=True)
