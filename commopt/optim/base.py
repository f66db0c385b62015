"""The orchestration every commopt optimizer shares: agree, lay out, run the algorithm, commit.

Each piece owns its state: buckets, their cohorts and what a resume restores (:mod:`._layout`,
:mod:`.flat_state`), agreement (:mod:`._agreement`), backend and exchange
(:mod:`._communication`), freeze point (:mod:`.freeze`), master weights (:mod:`.adam`), config
(:mod:`.config`), work started during backward (:mod:`._early`). A subclass names its flat keys
and implements ``_step(ctx)`` and ``_early_plan(ops)``: the base hands it its collaborators, a
:class:`StepContext` for each step and the :class:`BucketOps` its early plan exchanges with, and
the algorithm calls them the way torch's ``Adam`` calls ``adam(...)``."""

from __future__ import annotations

import contextlib
import copy
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch.optim.optimizer import ParamsT

from commopt.buckets import DEFAULT_BUCKET_NUMEL, Segment, local_shards
from commopt.comm import Backend
from commopt.compressed import NonFiniteError
from commopt.exchange import Exchange
from commopt.join import (
    JOIN_DEVICE,
    JOIN_PROCESS_GROUP,
    disabled_join_config,
    notify,
    shadow_on_zero_gradients,
)
from commopt.notices import log_compression_started, warn_redone, warn_skipped
from commopt.optim._agreement import GradientAgreement, describe_param, left_untouched
from commopt.optim._communication import Communication
from commopt.optim._early import EarlyPlan, Kind
from commopt.optim._early._thread import CommThread
from commopt.optim._early._work import EarlyWork, GradientHooks
from commopt.optim._layout import (
    BucketLayout,
    Cohorts,
    commopt_entry,
    keep_state_dtypes,
    late_starters,
    refuse_late_start,
    split_commopt_entry,
    start_cohorts,
)
from commopt.optim.adam import (
    ZeroVarianceGuard,
    apply_exp_avg_mask_,
    master_weights,
    unscale_grads_,
)
from commopt.optim.config import (
    CommOptions,
    check_no_scaler_after_early_work,
    check_param_group,
)
from commopt.optim.flat_state import FlatState, grouped_segments
from commopt.optim.freeze import AutoFreeze, FreezePoint
from commopt.sharding import Sharding, refuse_unattached_shards, unlike_shards, unshardable

__all__ = ["BucketOps", "CompressedOptimizer", "StepContext"]


class BucketOps:
    """The operations on a bucket that an algorithm, in ``step()`` and in its early plan, runs
    with other ranks or against the shared variance: the error-compensated 1-bit exchange and
    the momentum's mask. One per optimizer; it owns no optimizer state.

    Args:
        comm: the optimizer's backend and exchange, which counts the rounds.
        owner: the optimizer's class name, for the zero-variance warning (once, rank 0).
    """

    def __init__(self, comm: Communication, owner: str) -> None:
        self._comm = comm
        self._guard = ZeroVarianceGuard(owner)
        #: compute ``comm_stats()["compression_error"]`` (one dot product per compressed call)
        self.track_compression_error = True

    def exchange(
        self, state: FlatState, flat: torch.Tensor, errors: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """flat ← C(flat): the error-compensated 1-bit average across ranks (SPEC §1), written
        back, with the bucket's error buffers or ``errors`` (staged copies, :mod:`._early`)."""
        errors = state.comm if errors is None else errors
        return self._comm.compress(flat, errors, self.track_compression_error)

    def mask(self, state: FlatState, flat: torch.Tensor, groups: Sequence[dict[str, Any]]) -> None:
        """flat ← flat ⊙ exp_avg_mask ⊙ [v ≠ 0], on what a compressed exchange returned
        (``exp_avg_mask`` of each segment's group in ``groups``)."""
        apply_exp_avg_mask_(flat, state, groups)
        self.discard_zero_variance(state, flat, warn=True)

    def discard_zero_variance(self, state: FlatState, flat: torch.Tensor, warn: bool) -> None:
        """flat ← 0 wherever v is exactly 0 (:class:`ZeroVarianceGuard`; ``warn``: once, on
        rank 0)."""
        self._guard.apply_(state, flat, warn=warn and self._comm.backend.rank == 0)


class StepContext:
    """One step's collaborators, built by the optimizer for each step and handed to the
    algorithm's ``_step(ctx)``: the step, the buckets and their param groups, the freeze point,
    and the operations that involve other ranks: ḡ (:meth:`averaged_grads`), C(x)
    (:meth:`exchange`), the mask, and what the early work already did (:meth:`take`)."""

    def __init__(
        self,
        step: int,
        states: list[FlatState],
        groups: list[dict[str, Any]],
        ops: BucketOps,
        comm: Communication,
        early: EarlyWork | None,
        freeze: FreezePoint,
        idle: frozenset[int] = frozenset(),
    ) -> None:
        #: the step being taken, counted from 1
        self.step = step
        #: ``id`` of each parameter that sits this step out, agreed by every rank (no gradient
        #: on any); it comes out of the step as it went in, and counts its own steps
        #: (:meth:`FlatState.count_idle`). Empty in a step that does not communicate.
        self.idle = idle
        #: the buckets, in layout order
        self.states = states
        #: the optimizer's param groups
        self.groups = groups
        #: the freeze point: ``freeze.last_full_step()``, ``freeze.observe(step, level)``
        self.freeze = freeze
        self.ops = ops
        self._comm, self._early = comm, early

    def segments(self, state: FlatState) -> list[tuple[Segment, dict[str, Any]]]:
        """Each segment of the bucket with its param group."""
        return grouped_segments(state, self.groups)

    def averaged_grads(self, state: FlatState) -> torch.Tensor:
        """ḡ: the bucket's gradients averaged at full precision, flat, in scratch ``"grad"``
        (not again where the early work did)."""
        g = state.scratch("grad")
        if self._early is not None:
            return self._early.averaged_grads(state, self.step, g)
        self._comm.average(state.gather_grads(g))
        return g

    def exchange(
        self, state: FlatState, flat: torch.Tensor, errors: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """flat ← C(flat) (:meth:`BucketOps.exchange`)."""
        return self.ops.exchange(state, flat, errors)

    def mask(self, state: FlatState, flat: torch.Tensor) -> None:
        """flat ← flat ⊙ exp_avg_mask ⊙ [v ≠ 0] (:meth:`BucketOps.mask`)."""
        self.ops.mask(state, flat, self.groups)

    def take(self, kind: Kind, state: FlatState) -> torch.Tensor | None:
        """What the early work (a DDP hook, ``overlap=True``) already did of this step's
        ``kind`` for the bucket, its error buffers committed; None: nothing, the algorithm
        does it all. :attr:`Kind.MOMENTUM`: the exchanged momentum, committed into
        ``exp_avg``; :attr:`Kind.GRADIENT`: the 1-bit exchanged gradient (a staged buffer)."""
        if self._early is None:
            return None
        if kind is Kind.MOMENTUM:
            taken = self._early.take_momentum(state, self.step)
            return state.flat["exp_avg"] if taken else None
        if kind is Kind.GRADIENT:
            return self._early.take_gradient(state, self.step)
        raise ValueError(f"nothing to take of kind {kind!r}: averages are averaged_grads")


class CompressedOptimizer(torch.optim.Optimizer):
    """Base class: subclasses implement ``_step(ctx)`` and ``_early_plan(ops)`` and name their
    flat state keys; ``config`` is their :class:`~commopt.optim.config.CommOptions` subclass."""

    #: per-parameter fp32 state kept in flat bucket buffers, identical on all ranks
    _flat_keys: tuple[str, ...] = ()
    #: like ``_flat_keys`` but allocated only when the algorithm first asks (``buffer(key)``)
    _lazy_flat_keys: tuple[str, ...] = ()
    #: one fp32 scalar per parameter tensor (key → initial value); ``state[p][key]`` is 0-d
    _scalar_keys: ClassVar[dict[str, float]] = {}
    #: the bucket size cap when ``bucket_numel`` is None (None: one bucket per device)
    _default_bucket_numel: ClassVar[int | None] = DEFAULT_BUCKET_NUMEL
    _late_cohorts: ClassVar[bool] = True  # first trained late: own schedule (:mod:`._layout`)
    #: each param group in buckets of its own (0/1 Adam: a sync's 1-bit scale is per lr)
    _bucket_per_group: ClassVar[bool] = False
    #: the config field that may be ``"auto"`` or an AutoFreezeSettings (AutoFreeze decides)
    _freeze_field: ClassVar[str] = "freeze_step"
    # torch's Joinable protocol: Join([ddp_model, optimizer]) on uneven inputs (commopt.join)
    join_hook = shadow_on_zero_gradients
    join_device = JOIN_DEVICE
    join_process_group = JOIN_PROCESS_GROUP

    def __init__(
        self,
        params: ParamsT,
        defaults: dict[str, Any],
        config: CommOptions,
        backend: Backend | None,
    ) -> None:
        name = type(self).__name__
        #: the schedule and communication options, frozen (:mod:`commopt.optim.config`)
        self.config = config
        #: the step counter and any schedule state the ranks share; saved in ``state_dict()``
        self.global_state: dict[str, Any] = {"step": 0, "skipped_steps": 0}
        self._comm = Communication(backend, config)
        self._ops = BucketOps(self._comm, name)
        keys = (self._flat_keys, self._lazy_flat_keys, self._scalar_keys)
        self._layout = BucketLayout(name, *keys, bucket_per_group=self._bucket_per_group)
        numel = config.bucket_numel
        self._bucket_numel = self._default_bucket_numel if numel is None else numel
        self._agreement = GradientAgreement(name, config)
        self._freeze = FreezePoint(getattr(config, self._freeze_field), self.global_state)
        self._early: EarlyWork | None = None  # work started before step() (commopt.ddp)
        self._thread: CommThread | None = None  # overlap=True: runs the early collectives
        self._hooks = GradientHooks(self._weak_early_work())
        self._compression_announced = False  # logged once, on rank 0
        self._join_config = disabled_join_config()  # (torch's Join sets it)
        super().__init__(params, defaults)
        if config.overlap:  # the channel opens collectively, while every rank constructs
            self._thread = CommThread.opened(f"commopt-{name}", self.backend)
            weakref.finalize(self, self._thread.close)  # (stopped once the optimizer is dropped)
            if not self._thread.channel and self.backend.world_size > 1:
                raise ValueError(
                    f"{name}: overlap=True needs a backend that opens a communicator of its own "
                    f"for its thread (the default torch.distributed group, MPI); {self.backend!r} "
                    "cannot (a torch.distributed group other than the default one could only "
                    "be copied by every process of the job), and the thread would then share "
                    "the communicator with step()'s own collectives and hang or abort. Use "
                    "overlap=False with this backend (docs/overlap.md)"
                )
            self._hooks.enable([p for g in self.param_groups for p in g["params"]])

    # -- hooks for subclasses -----------------------------------------------------------------
    def _step(self, ctx: StepContext) -> None:  # pragma: no cover - every subclass defines it
        """Run step ``ctx.step`` (counted from 1) of the algorithm; gradients were agreed on."""
        raise NotImplementedError(f"{type(self).__name__} must define _step")

    def _early_plan(self, ops: BucketOps) -> EarlyPlan:  # pragma: no cover - every subclass
        """What of a bucket's next step may start during backward, and how it is exchanged."""
        raise NotImplementedError(f"{type(self).__name__} must define _early_plan")

    def _communicates(self, step: int) -> bool:
        """Whether step ``step`` talks to other ranks (False: agrees on nothing; _skip_local)."""
        del step
        return True

    def _skip_local(self, step: int) -> None:  # pragma: no cover - only with local steps
        """Local step ``step`` had a non-finite gradient on this rank: drop this rank's update
        but advance whatever schedule the ranks share, so they stay in lock step."""
        raise NotImplementedError(f"{type(self).__name__} must define _skip_local")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``; the group remembers the step it joined at
        (``first_step``), and its parameters start their own schedule from there.

        Raises:
            TypeError, ValueError: what the constructor refuses in a group (a float64 or
                complex parameter, a per-group config key, a non-number hyperparameter), or,
                on FSDP2 shards, a parameter that is not sharded like the others. The group
                refused is not added.
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:  # a group refused is not kept (the next step would trip over it)
            check_param_group(group, type(self).__name__, self.config, self.defaults)
            if self._comm.sharding is not None:
                self._check_group_is_sharded(group)
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        group.setdefault("first_step", self.global_state["step"])
        if self._layout.states is not None:
            self._lay_out()
        if self._hooks.enabled:
            self._hooks.attach(group["params"])
        # (added on some ranks only: the next step's model check fails on every rank alike)

    def __getstate__(self) -> dict[str, Any]:  # copy.deepcopy (torch's: state and groups only)
        return {k: v for k, v in self.__dict__.items() if k not in ("_hooks", "_early", "_thread")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__({**state, "_early": None, "_thread": None})  # steps as overlap=False
        self._hooks = GradientHooks(self._weak_early_work())

    # -- backend, exchange, layout ------------------------------------------------------------
    @property
    def requested_backend(self) -> Backend | None:
        """The constructor's ``backend`` argument (None: resolved at first use)."""
        return self._comm.requested

    @property
    def backend(self) -> Backend:
        """The resolved communication backend (``backend=None`` → SPEC §5, at first use)."""
        return self._comm.backend

    @property
    def exchange(self) -> Exchange:
        """How buckets are averaged at one bit (SPEC §1, or hierarchical per ``topology``)."""
        return self._comm.exchange

    # -- the freeze point (commopt.optim.freeze.FreezePoint, kept in global_state) -------------
    def frozen_after(self) -> float:
        """The last full-precision step: the config's, or the one AutoFreeze chose (or inf)."""
        return self._freeze.last_full_step()

    @property
    def auto_freeze(self) -> AutoFreeze:
        """The automatic freeze rule and its state (restored from ``global_state``)."""
        return self._freeze.rule

    @property
    def flat_states(self) -> list[FlatState]:
        """One :class:`FlatState` per bucket (laid out at the first use)."""
        states = self._layout.states  # (None: not laid out; [] when nothing has trained yet)
        return states if states is not None else self._lay_out()

    def _lay_out(self) -> list[FlatState]:
        """The buckets laid out anew, over the groups, state and cohorts as they are now."""
        groups, numel, cohorts = (
            self.param_groups,
            self._bucket_numel,
            Cohorts.of(self.global_state),
        )
        if self._comm.sharding is None:
            refuse_unattached_shards(type(self).__name__, groups)
        args = (groups, self.state, numel, self.exchange, self.backend, cohorts)
        return self._layout.lay_out(*args, sharding=self._comm.sharding)

    # -- sharded parameters (commopt.fsdp) -----------------------------------------------------
    def _check_group_is_sharded(self, group: dict[str, Any]) -> None:
        like = next(p for g in self.param_groups for p in g["params"])
        topology = self.config.topology
        refuse = unshardable(0, topology, [group]) or unlike_shards(group["params"], like)
        if refuse is not None:
            raise ValueError(
                f"{type(self).__name__} steps FSDP2 shards (commopt.fsdp.attach); the group "
                f"added cannot join them: {refuse}"
            )

    @property
    def sharding(self) -> Sharding | None:
        """The shard and replicate groups of sharded parameters (:meth:`shard_over`); None."""
        return self._comm.sharding

    def shard_over(self, sharding: Sharding) -> None:
        """Step sharded parameters (DTensor shards, :mod:`commopt.sharding`): the state takes
        each parameter's shard, gradients are averaged and exchanged over
        ``sharding.replicate``, per-tensor sums run over ``sharding.shard``.
        :func:`commopt.fsdp.attach` calls it; call it before the first step.

        Raises:
            ValueError: the optimizer has stepped, or uses what has no sharded form yet
                (``overlap=True``, a DDP hook, ``exp_avg_mask``, non-fp32 sharded parameters,
                ``topology`` other than ``"flat"``).
        """
        name = type(self).__name__
        refuse = unshardable(self.global_state["step"], self.config.topology, self.param_groups)
        if refuse is None and (self.overlap or self._early is not None):
            refuse = "its gradients are already exchanged during backward (overlap or a DDP hook)"
        if refuse is not None:
            raise ValueError(f"{name} cannot step sharded parameters: {refuse}")
        self._comm.shard_over(sharding)
        self._layout.forget(None)  # laid out anew over the shards
        self._agreement.forget()

    def first_step(self, state: FlatState) -> int:
        """The global step before this bucket's parameters joined (0 for the constructor's)."""
        return state.bucket.first_step

    def segments(self, state: FlatState) -> list[tuple[Segment, dict[str, Any]]]:
        """Each segment of the bucket with its param group."""
        return grouped_segments(state, self.param_groups)

    @property
    def track_compression_error(self) -> bool:
        """Compute ``comm_stats()["compression_error"]`` (one dot product per compressed call;
        default True)."""
        return self._ops.track_compression_error

    @track_compression_error.setter
    def track_compression_error(self, value: bool) -> None:
        self._ops.track_compression_error = bool(value)

    # -- work started before step(): the DDP hook (commopt.ddp) or overlap=True ---------------
    @property
    def early_work(self) -> EarlyWork:
        """Work a DDP hook or ``overlap=True`` started on the buckets during backward, staged
        until ``step()`` takes or skips it (:mod:`commopt.optim._early`)."""
        if self._early is None:
            self._early = EarlyWork(
                layout=lambda: self.flat_states,
                groups=lambda: self.param_groups,
                next_step=lambda: self.global_state["step"] + 1,
                comm=self._comm,
                plan=self._early_plan(self._ops),
                thread=self._thread,
            )
        return self._early

    @property
    def overlap(self) -> bool:
        """The constructor's ``overlap``: each bucket's communication starts during backward."""
        return self._thread is not None

    def _weak_early_work(self) -> Callable[[], EarlyWork]:
        """``early_work``, reached weakly: the hooks on the parameters outlive an optimizer
        often enough (a new one per phase), and must not keep it (or its thread) alive."""
        ref = weakref.ref(self)
        return lambda: ref().early_work  # type: ignore[union-attr]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside start no communication (gradient accumulation with
        ``overlap=True``: every pass but the last before ``step()``), like DDP's ``no_sync``."""
        previous, self._hooks.paused = self._hooks.paused, True
        try:
            yield
        finally:
            self._hooks.paused = previous

    # -- torch.optim.Optimizer API ------------------------------------------------------------
    @torch.compiler.disable  # communicates: torch.compile(opt.step) runs it as it is, eagerly
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step: agree on the gradients, run the algorithm, or skip on every rank alike."""
        notify(self)  # this rank still has data (inside torch's Join; commopt.join)
        with torch.enable_grad():
            loss = None if closure is None else closure()
        params = [p for g in self.param_groups for p in g["params"]]
        try:
            if self.overlap:  # the thread's collectives come first (on every rank, one that
                self.early_work.drain(agree=True)  # skipped backward included)
            elif self._early is not None:
                self._early.drain()
            self._agreement.check_model(self.backend, params, self.param_groups)
            states = self.flat_states
            step = self.global_state["step"] + 1
            loss = self._agree_and_step(step, params, states, loss)
            if self._early is not None:
                self._early.fix_order()
            return loss
        finally:
            if self._early is not None:  # taken or skipped: nothing staged survives the step
                self._early.clear()
            for state in self._layout.states or []:  # scratch is dead once the step is over
                state.release_scratch()

    def _agree_and_step(
        self, step: int, params: list[torch.Tensor], states: list[FlatState], loss: float | None
    ) -> float | None:
        collective = self._communicates(step)
        early = self._early  # did what the early work read change? (this rank)
        why = early and (early.mismatch or early.reads.stale(step, self.param_groups))
        averaged = early is None and self.sharding is None  # (by DDP?) checked at first
        verdict = self._agreement.verdict(  # may_be_averaged (by DDP) without early work, redo
            self.backend, params, self.param_groups, collective, averaged, why is not None
        )
        if self._early is not None and (verdict.redo or (why is not None and not collective)):
            # What the early work read changed after backward (on some rank): redo the step
            # as overlap=False would, from p.grad, the same bits (docs/overlap.md).
            if collective and verdict.redo and self._early.mismatch is None:
                self._early.decline()  # agreed on every rank: no second redo, no double cost
            self._early.clear()
            warn_redone(type(self).__name__, why, self.backend.rank, self.overlap)
        if collective and params and len(verdict.without_grad) == len(params):
            return loss  # no gradient on any rank: not a step, as for torch.optim (not counted)
        if verdict.nonfinite:
            self._skip(step, "non-finite gradient", collective)
            if not collective:  # a local step: the shared schedule still moves on
                self.global_state["step"] = step
                with master_weights(states, self.state):
                    self._skip_local(step)
            return loss
        if self._early is not None and self._early.failed(step):  # agreed by every rank
            self._skip(step, "non-finite values to exchange", True)
            return loss
        gs, groups = self.global_state, self.param_groups
        late = late_starters(gs, verdict.without_grad, groups, step) if collective else []
        if late or self._layout.untrained != Cohorts.of(gs).untrained:  # (:mod:`._layout`)
            states = self._start_late(late, step)
        scale = getattr(self, "grad_scale", None)
        if scale is not None:
            check_no_scaler_after_early_work(
                type(self).__name__, self._early is not None and self._early.started_any(step)
            )
            unscale_grads_(params, scale)
        self.global_state["step"] = step
        try:
            untouched = [params[i] for i in verdict.without_grad if i not in self._layout.untrained]
            idle = frozenset(map(id, untouched)) if collective else frozenset()
            ctx = StepContext(
                step, states, groups, self._ops, self._comm, self._early, self._freeze, idle
            )
            with left_untouched(untouched, self.state), local_shards(s.bucket for s in states):
                with master_weights(states, self.state):
                    self._step(ctx)
            if not self._compression_announced and self._comm.compressed_rounds > 0:
                self._compression_announced = True
                log_compression_started(type(self).__name__, step, self.backend.rank)
        except NonFiniteError:  # raised on every rank alike; the algorithm restored its state
            self.global_state["step"] = step - 1
            self._skip(step, "non-finite values to exchange", True)
        return loss

    def _start_late(self, late: list[int], step: int) -> list[FlatState]:
        """Lay out anew: late ones start a cohort at ``step`` − 1; untrained ones hold nothing."""
        if late and not self._late_cohorts and step > self.frozen_after():
            where = [describe_param(self.param_groups, i) for i in late]
            refuse_late_start(type(self).__name__, late, where, step)
        if late and self._late_cohorts:
            start_cohorts(self.global_state, late, step)
        if self._early is not None:  # what backward started was for the old buckets: redone
            self._early.clear()
        return self._lay_out()

    def _skip(self, step: int, why: str, collective: bool) -> None:
        self.global_state["skipped_steps"] += 1  # (warn_skipped says why)
        warn_skipped(type(self).__name__, step, why, collective, self.backend.rank)

    # GradScaler.step(opt) calls step() on every rank with grad_scale set, not skipping it where
    # it found an inf (which would leave others waiting): agreeing on non-finite grads is ours.
    _step_supports_amp_scaling = True

    def comm_stats(self) -> dict[str, Any]:
        """Traffic, rounds and ``compression_error`` (:meth:`Communication.stats`)."""
        if self._early is not None:  # overlap: count what the thread can finish now
            self._early.settle()
        return self._comm.stats(self.global_state["skipped_steps"], self._layout.states or [])

    # -- checkpoints (commopt.optim._layout) ---------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's plus ``"commopt"``: config, schedule, this rank's exchange buffers."""
        sd = super().state_dict()
        entry = self.config, self.global_state, self.backend, self.exchange.name
        sd["commopt"] = commopt_entry(*entry, self._layout.comm_state_dicts(), type(self).__name__)
        return sd

    def load_state_dict(
        self, state_dict: dict[str, Any], *, allow_config_change: bool = False
    ) -> None:
        """torch's ``load_state_dict`` after :meth:`check_state_dict`: a refusal changes nothing;
        ``allow_config_change=True`` resumes under this optimizer's config on purpose."""
        state_dict, comm, global_state, freeze = self._checked(state_dict, allow_config_change)
        if self._early is not None:  # nothing may be in flight on the buffers replaced here
            self._early.drain()
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # state dicts saved before first_step existed
            group.setdefault("first_step", 0)
        keep_state_dtypes(self.state, self.param_groups, state_dict)
        self.global_state = global_state
        self._freeze = freeze
        self._layout.forget(comm)  # flat buffers and agreement: rebuilt at the next use
        self._early = None  # nothing staged survives a load
        self._agreement.forget()

    def check_state_dict(
        self, state_dict: dict[str, Any], *, allow_config_change: bool = False
    ) -> None:
        """Raise the ``ValueError`` that :meth:`load_state_dict` would, changing nothing: another
        config (``freeze_step``: another phase), an undecided automatic freeze saved with a
        smaller ``fraction``, other group sizes, or exchange buffers saved for other buckets
        (another ``bucket_numel``). :func:`commopt.load_checkpoint` asks it on every rank."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an allowed change is warned about at the load
            self._checked(state_dict, allow_config_change)

    def _checked(self, state_dict: dict[str, Any], allow: bool) -> tuple[Any, ...]:
        groups = self.param_groups
        sd, comm = split_commopt_entry(state_dict, self.config, type(self).__name__, allow, groups)
        schedule = self.global_state if comm is None else copy.deepcopy(comm["global"])
        freeze = FreezePoint(self._freeze.value, schedule)  # refuses what cannot continue
        if comm is not None and comm.get("buckets"):  # (the exchange is built only if needed)
            groups, numel = self.param_groups, self._bucket_numel
            args = (groups, numel, self.exchange, self.backend)
            self._layout.check_loadable(sd["param_groups"], comm, *args)
        return sd, comm, schedule, freeze
