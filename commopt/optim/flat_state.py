"""One bucket's optimizer state: flat fp32 buffers, per-tensor scalars, this rank's exchange state.

Moments live in flat buffers the size of the bucket, so that the exchange and the update see
one long vector; ``state[p][key]`` holds *views* into them, so ``state_dict()`` looks like
torch's and a loaded per-parameter state flows back into the flat buffers. Per-tensor scalars
(LAMB's coefficients) are one flat buffer with a 0-d view per parameter.

What is derived from the variance v (the Adam denominator, the indices where v is exactly 0) is
kept and recomputed when ``v._version`` moves: any in-place write to v invalidates it, so no
caller has to remember to say that v changed.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Mapping, MutableMapping, Sequence
from typing import Any

import torch

from commopt.buckets import Bucket, Segment
from commopt.sharding import local

__all__ = ["FlatState", "grouped_segments", "poison_scratch"]


def poison_scratch() -> bool:
    """Whether scratch buffers are debug-poisoned (``COMMOPT_POISON_SCRATCH=1``): created full
    of NaN and dropped after every step on every device, with nothing derived from them kept
    between steps, so a CPU run reads scratch exactly as a GPU run does and any value read from
    a buffer no one wrote this step turns into NaN (tests/multirank/test_device_logic_gloo.py)."""
    return os.environ.get("COMMOPT_POISON_SCRATCH", "") not in ("", "0")


class FlatState:
    """The state of one bucket (see the module docstring).

    Args:
        bucket: the parameters and their layout.
        param_state: the optimizer's ``state`` mapping; views are written into it, and values
            already there (a loaded state dict) are copied into the new flat buffers.
        keys: flat keys allocated now.
        lazy_keys: flat keys allocated on first use (:meth:`buffer`), or now if loaded.
        scalar_keys: per-tensor scalar keys and their initial values.
        comm_numels: the exchange's per-rank buffers (name → element count), zeros.
    """

    def __init__(
        self,
        bucket: Bucket,
        param_state: MutableMapping[torch.Tensor, dict[str, Any]],
        keys: Iterable[str],
        lazy_keys: Iterable[str],
        scalar_keys: Mapping[str, float],
        comm_numels: Mapping[str, int],
    ) -> None:
        self.bucket = bucket
        self._param_state = param_state
        # the parameters as param_state knows them (inside a step, master_weights shows the
        # algorithm fp32 stand-ins for bf16/fp16 ones in bucket.params)
        self._owners = list(bucket.params)
        self.flat: dict[str, torch.Tensor] = {}
        for key in keys:
            self.flat[key] = self._new_flat(key)
        for key in lazy_keys:
            if any(key in param_state[p] for p in bucket.params):
                self.flat[key] = self._new_flat(key)
        self.scalars: dict[str, torch.Tensor] = {}
        for key, initial in scalar_keys.items():
            buf = torch.full(
                (len(bucket.params),), initial, dtype=torch.float32, device=bucket.device
            )
            for i, p in enumerate(bucket.params):
                old = param_state[p].get(key)
                if old is not None:
                    buf[i].copy_(old)
                param_state[p][key] = buf[i]
            self.scalars[key] = buf
        self.comm = {
            name: torch.zeros(numel, dtype=torch.float32, device=bucket.device)
            for name, numel in comm_numels.items()
        }
        self._scratch: dict[str, torch.Tensor] = {}
        self._poison = poison_scratch()
        # Kept between steps on CPU (see scratch()); dropped by release_scratch() elsewhere.
        self._keep_scratch = bucket.device.type == "cpu" and not self._poison
        self._denominator_key: tuple | None = None
        self._zero_variance_key: int | None = None
        self._zero_variance: torch.Tensor | None = None
        self._tiny_variance_key: tuple | None = None
        self._tiny_variance: torch.Tensor | None = None
        self._tiny_by_range: dict[tuple[int, int], torch.Tensor | None] = {}
        self._guard_base_key: tuple | None = None

    # -- buffers ------------------------------------------------------------------------------
    def _new_flat(self, key: str) -> torch.Tensor:
        buf = self.bucket.new_buffer()
        for p, view in zip(self._owners, self.bucket.views(buf), strict=True):
            old = self._param_state[p].get(key)
            if old is not None:
                view.copy_(old)
            self._param_state[p][key] = view
        return buf

    def buffer(self, key: str) -> torch.Tensor:
        """The flat buffer of ``key``, created (zeros, or the loaded values) on first use."""
        if key not in self.flat:
            self.flat[key] = self._new_flat(key)
        return self.flat[key]

    def scratch(self, name: str) -> torch.Tensor:
        """A flat fp32 work buffer of the bucket's size, named ``name`` (not state).

        The same buffer for the same name until :meth:`release_scratch`, on every device: an
        algorithm may write m_prev into ``scratch("work")`` in one method and read it in the
        next. Its contents are undefined when first handed out in a step.

        ``step()`` releases scratch when it ends. On CPU the buffers are kept all the same:
        allocated afresh, a buffer of tens of MB comes from the OS as new pages, zeroed on first
        touch, which costs more than the pass that fills it (a 100 MB gradient copy measured
        71 ms into a fresh buffer, 22 ms into a kept one, on this project's CPU). On other
        devices they are dropped: CUDA's caching allocator makes a new one cheap, and gives the
        memory to activations between steps, where a kept buffer would stay resident through
        forward and backward.
        """
        buf = self._scratch.get(name)
        if buf is None:
            bucket = self.bucket
            if self._poison:
                buf = torch.full(
                    (bucket.numel,), float("nan"), dtype=torch.float32, device=bucket.device
                )
            else:
                buf = torch.empty(bucket.numel, dtype=torch.float32, device=bucket.device)
            self._scratch[name] = buf
        return buf

    def release_scratch(self) -> None:
        """End of a step: scratch contents are dead. Dropped on non-CPU devices (and always
        when poisoned, see :func:`poison_scratch`), together with what was derived from them."""
        if self._keep_scratch:
            return
        self._scratch.clear()
        self._denominator_key = None
        self._guard_base_key = None

    def gather_grads(self, out: torch.Tensor) -> torch.Tensor:
        """Copy this rank's gradients into ``out`` (flat fp32); a missing gradient counts as 0."""
        for p, view in zip(self.bucket.params, self.bucket.views(out), strict=True):
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad)
        return out

    def gather_params(self, out: torch.Tensor) -> torch.Tensor:
        """Copy the parameters into ``out`` (flat fp32)."""
        for p, view in zip(self.bucket.params, self.bucket.views(out), strict=True):
            view.copy_(p)
        return out

    def set_params(self, flat: torch.Tensor) -> None:
        """p ← flat (fp32), cast to each parameter's dtype."""
        for p, view in zip(self.bucket.params, self.bucket.views(flat), strict=True):
            p.copy_(view)

    # -- derived from v -----------------------------------------------------------------------
    def denominator(
        self,
        bias_sqrt: list[float],
        eps: list[float],
        segments: Sequence[Segment] | None = None,
    ) -> torch.Tensor:
        """d = √v / b + ε over the bucket, segment by segment (read-only; v = ``exp_avg_sq``);
        ``segments``: the bucket's own unless given (:meth:`idle_runs`' runs), covering it.

        Kept on CPU and rebuilt only when v, b or ε change: in the compression stages v is
        frozen, and rebuilding d would be three passes over the model every step. Computed
        once per step on other devices, where scratch does not outlive the step
        (:meth:`scratch`).
        """
        v = self.flat["exp_avg_sq"]
        segments = self.bucket.segments if segments is None else segments
        bounds = tuple(seg.start for seg in segments)
        key = (v._version, tuple(bias_sqrt), tuple(eps), bounds)
        d = self.scratch("denominator")
        if self._denominator_key == key:
            return d
        for seg, b, e in zip(segments, bias_sqrt, eps, strict=True):
            denominator_(d[seg.start : seg.stop], v[seg.start : seg.stop], b, e)
        self._denominator_key = key
        return d

    def zero_variance(self) -> torch.Tensor | None:
        """Indices of the elements whose v is exactly 0 (``None`` if there are none).

        Found once per value of v and kept as indices: usually few, and an indexed fill costs
        nothing next to ``masked_fill_`` with a boolean mask of the whole bucket (47 ms for
        25M elements on this project's CPU, every step).
        """
        v = self.flat["exp_avg_sq"]
        if self._zero_variance_key != v._version:
            where = (v == 0).nonzero().squeeze(1)
            self._zero_variance = where if where.numel() else None
            self._zero_variance_key = v._version
        return self._zero_variance

    def tiny_variance(self, ratio: float) -> torch.Tensor | None:
        """Indices of the elements whose v is below ``ratio`` times the mean v of their own
        parameter tensor (``None`` if there are none): the step guard's candidates.

        Found once per value of v and kept, like :meth:`zero_variance` (v is frozen in the
        compression stages). v is bit-identical on every rank, so the indices are too.
        """
        v = self.flat["exp_avg_sq"]
        key = (v._version, ratio)
        if self._tiny_variance_key != key:
            parts = []
            views = self.bucket.views(v)
            for view, offset, mean in zip(
                views, self.bucket.offsets, self._means(views), strict=True
            ):
                flat = view.reshape(-1)
                where = (flat < ratio * mean).nonzero().squeeze(1)
                if where.numel():
                    parts.append(where + offset)
            self._tiny_variance = torch.cat(parts) if parts else None
            self._tiny_variance_key = key
            self._tiny_by_range = {}
        return self._tiny_variance

    def _means(self, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """The mean of each parameter's values in ``views``: of the whole tensor when the bucket
        holds shards (the shards' sums added over the shard group, over its whole count)."""
        sharding = self.bucket.sharding
        if sharding is None:
            return [view.mean() for view in views]
        sums = torch.stack([view.sum() for view in views]) if views else torch.zeros(0)
        sharding.sum_over_shards_(sums)
        counts = torch.tensor(self.bucket.tensor_numels, dtype=sums.dtype, device=sums.device)
        return list((sums / counts.clamp(min=1)).unbind())

    def tiny_variance_in(self, ratio: float, start: int, stop: int) -> torch.Tensor | None:
        """The indices of :meth:`tiny_variance` in [start, stop), relative to ``start``
        (``None`` if there are none); kept with them, so a step does not filter the whole
        index list again for every segment (read-only: callers must not write into it)."""
        tiny = self.tiny_variance(ratio)
        if tiny is None:
            return None
        cached = self._tiny_by_range.get((start, stop), ...)
        if cached is ...:
            where = tiny[(tiny >= start) & (tiny < stop)]
            cached = self._tiny_by_range[(start, stop)] = where - start if where.numel() else None
        return cached

    def guard_denominator_base(self, d: torch.Tensor) -> torch.Tensor:
        """A bucket-sized buffer that equals the denominator ``d`` (the one :meth:`denominator`
        returned last) except where the step guard writes: the guard then only rewrites its
        elements (:func:`commopt.optim.adam.guarded_denominator` with ``copy=False``).

        On CPU it is kept and refilled from d only when d was rebuilt (v, b or ε changed), so
        the compression stage does not copy the whole bucket every step; the guard's elements
        are a function of v, so every step rewrites the same ones. On other devices it is
        refilled once per step (see :meth:`scratch`).
        """
        buf = self.scratch("guarded denominator")
        key = self._denominator_key
        if key is None or self._guard_base_key != key:
            buf.copy_(d)
            self._guard_base_key = key
        return buf

    # -- the steps a parameter sat out -----------------------------------------------------------
    def count_idle(self, idle: Collection[int], keys: Iterable[str]) -> None:
        """``state[p][key]`` += 1 (from 0) for each of ``keys``, for this bucket's parameters
        whose ``id`` is in ``idle``: they sat out a step the others took (no gradient on any
        rank), and torch counts each parameter's own steps (``state[p]["step"]``)."""
        if not idle:  # (nearly every step: no loop over the bucket's parameters)
            return
        keys = tuple(keys)
        for p in self._owners:
            if id(p) in idle:
                entry = self._param_state[p]
                for key in keys:
                    entry[key] = entry.get(key, 0) + 1

    def idle_runs(
        self, groups: Sequence[dict[str, Any]], keys: Sequence[str]
    ) -> list[tuple[Segment, dict[str, Any], tuple[int, ...]]]:
        """Each segment with its param group and the steps its parameters sat out (``state[p]``
        of each of ``keys``, 0 where unset: :meth:`count_idle`), split into runs of parameters
        that sat out alike. Until a parameter sits a step out these are the bucket's segments,
        so the arithmetic over them is the same."""
        counts = [tuple(self._param_state[p].get(k, 0) for k in keys) for p in self._owners]
        zero = (0,) * len(keys)
        if all(c == zero for c in counts):
            return [(seg, groups[seg.group], zero) for seg in self.bucket.segments]
        runs, each = [], iter(counts)  # (the segments hold the bucket's parameters in order)
        for seg in self.bucket.segments:
            start, members, current = seg.start, [], None
            offset = seg.start
            for p in seg.params:
                count = next(each)
                if members and count != current:
                    runs.append((Segment(seg.group, start, offset, tuple(members)), current))
                    start, members = offset, []
                members.append(p)
                current = count
                offset += local(p).numel()
            if members:
                runs.append((Segment(seg.group, start, offset, tuple(members)), current))
        return [(seg, groups[seg.group], count) for seg, count in runs]

    # -- this rank's exchange state -----------------------------------------------------------
    def reset_comm(self) -> None:
        """Zero this rank's exchange buffers (error feedback starts over)."""
        for buf in self.comm.values():
            buf.zero_()

    def comm_state_dict(self) -> dict[str, Any]:
        """This rank's exchange buffers (copies) and the bucket's length."""
        return {"numel": self.bucket.numel, **{k: v.clone() for k, v in self.comm.items()}}

    def load_comm_state_dict(self, entry: Mapping[str, Any]) -> None:
        """Restore this rank's exchange buffers saved by :meth:`comm_state_dict`."""
        missing = sorted(set(self.comm) - set(entry))
        if entry.get("numel") != self.bucket.numel or missing:
            raise ValueError(
                f"saved exchange state does not fit this bucket: saved numel "
                f"{entry.get('numel')} with buffers {sorted(k for k in entry if k != 'numel')}, "
                f"have {self.bucket.numel} with {sorted(self.comm)}"
            )
        for key, buf in self.comm.items():
            value = entry[key]
            if value.shape != buf.shape:
                raise ValueError(
                    f"saved {key} has {value.numel()} elements, this exchange needs {buf.numel()}"
                )
            buf.copy_(value)


def grouped_segments(
    state: FlatState, groups: Sequence[dict[str, Any]]
) -> list[tuple[Segment, dict[str, Any]]]:
    """Each segment of the bucket with its param group (of ``groups``)."""
    return [(seg, groups[seg.group]) for seg in state.bucket.segments]


def denominator_(out: torch.Tensor, v: torch.Tensor, bias_sqrt: float, eps: float) -> None:
    r"""out = √v / b + ε, with b = √(1−β2ᵗ) (1 without bias correction)."""
    torch.sqrt(v, out=out)
    if bias_sqrt != 1.0:  # x / 1 == x exactly: skipping it changes no bit
        out.div_(bias_sqrt)
    out.add_(eps)
