r"""DiLoCo whose pseudo-gradient travels at one bit: :class:`DiLoCo`.

Each worker takes H inner steps with its own optimizer and its own data, communicating nothing.
Then the workers average the pseudo-gradient Δ = θ̄ − θ (the weights at the last sync minus the
weights now), an outer step moves the anchor θ̄ with the average, and every worker restarts from
the new anchor (Douillard et al., 2023, arXiv:2311.08105):

.. math::

    Δ̄ = \frac1n\sum_r (θ̄ − θ_r), \qquad
    b ← μ b + Δ̄, \qquad
    θ̄ ← θ̄ − η_{out}\,(Δ̄ + μ b) \;\text{(Nesterov)}, \qquad
    θ_r ← θ̄.

With ``compression="onebit"`` the average is SPEC §1's error-compensated exchange, its worker
and server errors kept per rank from one sync to the next; the outer default is a slightly
extrapolated average without momentum (η_out = 1.3, μ = 0): error feedback does the work of the
outer momentum (docs/algorithms/diloco.md has the experiment behind each default).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from commopt.choices import (
    COMPRESSIONS,
    Compression,
    OuterTopology,
    Scale,
)
from commopt.comm import Backend, resolve_backend
from commopt.comm.channels import on_channel, open_channel
from commopt.diloco import checkpointing
from commopt.diloco.agreement import (
    agree,
    agree_on_steps,
    check_shards,
    float_bits,
    warn_if_in_lockstep,
)
from commopt.diloco.averages import (
    Bf16Average,
    Fp32Average,
    OnebitAverage,
    PseudoGradientAverage,
    average_buffers_,
    average_gradients_,
    check_finite,
    local_shard,
)
from commopt.diloco.fragments import (
    Fragment,
    first_sync_offsets,
    shared_scratch,
    split_parameters,
)
from commopt.diloco.inner import scaled_step_inner, step_inner
from commopt.diloco.schedule import (
    Progress,
    Settings,
    settings_read_through,
)
from commopt.exchange import build_exchange, discover_topology
from commopt.exchange.levels import build_level_backends, wants_shared_memory
from commopt.join import (
    JOIN_DEVICE,
    JOIN_PROCESS_GROUP,
    disabled_join_config,
    notify,
    shadow_without_gradients,
)
from commopt.optim.adam import refuse_complex_and_float64

__all__ = ["DiLoCo"]


@settings_read_through
class DiLoCo(torch.optim.Optimizer):
    r"""An outer loop around any ``torch.optim`` optimizer: H local steps, then one averaged
    outer step (module docstring).

    It is a ``torch.optim.Optimizer`` the way torch's own ``PostLocalSGDOptimizer`` is: it wraps
    the inner optimizer, whose ``param_groups``, ``state`` and ``defaults`` it shows as its own,
    so learning-rate schedulers, HF Trainer and Lightning take it as any optimizer (a schedule
    on it sets the inner optimizer's lr), and torch's step and state-dict hooks run on it.

    Usage::

        inner = torch.optim.AdamW(model.parameters(), lr=3e-4)
        opt = commopt.DiLoCo(inner, sync_every=50)          # collective: every rank builds it
        for x, y in loader:
            loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()

    Building it is collective: the ranks check that they agree on every setting below and on
    the parameters' sizes (a ``ValueError`` on every rank otherwise), and every rank starts from
    rank 0's parameters, which become the first anchor. Every parameter the inner optimizer
    holds is synced, frozen or not (one unfrozen later stays one model across the ranks; pass
    the inner optimizer only what you train, as the HF Trainer does, to send nothing for the
    rest). Right after each sync the synced parameters are bit-identical on every rank.

    Args:
        inner: the inner optimizer (``torch.optim.*`` or commopt's own), over the model's
            parameters; its state stays local to each worker, as in the paper. A learning-rate
            scheduler attaches to it or to DiLoCo alike (DiLoCo's param_groups are its).
        sync_every: H, inner steps between two syncs of a fragment.
        compression: how Δ is averaged (:mod:`commopt.diloco.averages`): ``"onebit"``
            (error-compensated 1 bit, ≈ 2 bits per parameter per sync), ``"none"`` (fp32,
            DiLoCo itself) or ``"bf16"``.
        outer_lr: η_out of the outer SGD; ``None``: the compression's entry in
            :data:`OUTER_DEFAULTS` (1.3 for each).
        outer_momentum: μ of the outer SGD; ``None``: as ``outer_lr`` (0 for each).
        nesterov: Nesterov momentum (the paper's) when μ > 0.
        fragments: P; sync 1/P of the parameters at a time, fragment p at inner steps
            W + ⌊(p+1)·H/P⌋ + k·H (Streaming DiLoCo). ``1``: all at once.
        delay: τ; a fragment's average runs on a communication thread while the next τ inner
            steps compute, and is applied after the τ-th: θ̄ moves as if it had been applied at
            once, and the fragment's parameters are set to the new θ̄, so the τ inner steps'
            changes to that fragment are dropped (which keeps replicas identical). Needs
            τ < H/P. ``0``: applied in the step that computed Δ.
        warmup_steps: W; the first W steps average gradients across all ranks at fp32 on every
            step (data parallel, as 1-bit Adam's warmup), and the anchor is taken after step W.
        fp32_syncs: K; each fragment's first K syncs average Δ by one fp32 all-reduce (as
            ``"none"``), the error buffers left at zero; ``compression`` from the (K+1)-th on.
            The early pseudo-gradients are the large ones, where one bit loses the most.
            ``None``: :func:`default_fp32_syncs`, with ``"onebit"`` the syncs of the first 50
            inner steps and at least two (docs/algorithms/diloco.md has the experiment), for
            K·64·(n−1)/n bits per parameter once; ``comm_stats()`` reports the rate after them
            apart. ``0``: 1 bit from the first sync.
        topology: ``"flat"``, or ``"hierarchical"``: every step averages gradients inside the
            node at fp32, so a node is one DiLoCo worker, and the sync crosses nodes through the
            hierarchical 1-bit exchange (``"none"``/``"bf16"`` average over all ranks).
        scale: ``"onebit"`` only: one 1-bit scale per parameter tensor (``"tensor"``,
            default: an exchange per tensor, 4 collectives each, so a layer whose Δ is small is
            not sent as ±the scale of a large one; docs/algorithms/diloco.md measured it) or one
            for the whole fragment (``"fragment"``: SPEC §1 over one fused buffer, 4 collectives
            per sync, for models of many tensors on links where latency counts).
        backend: where to communicate; ``None`` resolves as for the optimizers.
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        *,
        sync_every: int,
        compression: Compression = "onebit",
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        nesterov: bool = True,
        fragments: int = 1,
        delay: int = 0,
        warmup_steps: int = 0,
        fp32_syncs: int | None = None,
        topology: OuterTopology = "flat",
        scale: Scale = "tensor",
        backend: Backend | None = None,
    ) -> None:
        if not isinstance(inner, torch.optim.Optimizer) or isinstance(inner, DiLoCo):
            raise TypeError(
                "inner must be a torch.optim.Optimizer other than DiLoCo, got "
                f"{type(inner).__name__}"
            )
        #: :class:`~commopt.diloco.schedule.Settings`, checked, defaults resolved; fixed
        self.config = Settings(
            sync_every, compression, outer_lr, outer_momentum, nesterov, fragments, delay,
            warmup_steps, fp32_syncs, topology, scale,
        )  # fmt: skip
        # torch.optim.Optimizer.__init__ less its parameter groups (the inner optimizer's): the
        # hook registries, and step() wrapped so that step and global hooks run around it
        for kind in ("step", "state_dict", "load_state_dict"):
            for when in ("pre", "post"):
                setattr(self, f"_optimizer_{kind}_{when}_hooks", collections.OrderedDict())
        self._patch_step_function()
        self._join_config = disabled_join_config()  # (torch's Join sets it)
        self.inner = inner
        self.backend = resolve_backend(backend)
        be = self.backend
        self._params = [p for g in inner.param_groups for p in g["params"]]
        refuse_complex_and_float64("DiLoCo", self._params)  # (its anchors are fp32)
        agree(be, self.settings(), "DiLoCo")
        #: FSDP2 parameters: this rank's shards, averaged over ``backend``, the replicate group
        self.sharded = check_shards(be, self._params)
        if self.sharded and topology == "hierarchical":
            raise ValueError(
                "DiLoCo: topology='hierarchical' with FSDP2 parameters; FSDP2's shard group "
                "already is the island (its reduce-scatter averages the gradients inside it)"
            )

        # The node level: hierarchical islands average every step inside the node, on a group
        # of their own (never the one a delayed sync may be using on the other thread).
        self._node_backend: Backend | None = None
        node_topology = None
        if topology == "hierarchical":
            node_topology = discover_topology(be)
            if node_topology.local_size > 1:
                shm = wants_shared_memory(be, "auto")
                self._node_backend = build_level_backends(be, node_topology, shm)[0]
        self.average = self._build_average(node_topology)
        self._fp32 = Fp32Average(be)  # the first fp32_syncs syncs of each fragment
        runs = split_parameters(self._params, fragments)
        #: the fragments, in parameter order (:class:`~commopt.diloco.fragments.Fragment`)
        self.parts = [
            Fragment(
                run,
                self.average,
                momentum=self.outer_momentum > 0.0,
                per_tensor=compression == "onebit" and scale == "tensor",
                scratch=scratch,
            )
            for run, scratch in zip(runs, shared_scratch(runs), strict=True)
        ]
        self._offsets = first_sync_offsets(sync_every, fragments)
        for frag in self.parts:  # every rank starts from rank 0's weights
            be.broadcast(frag.gather_params_(frag.anchor), 0)
            frag.load_params_()

        self.progress = Progress(last_sync=[warmup_steps] * fragments)
        self._lockstep_checked = False  # at the first sync this object runs (agreement.py)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._channel: str | None = None
        if delay > 0:
            self._channel, closer = open_channel(be)  # collective, while every rank builds it
            self._executor = concurrent.futures.ThreadPoolExecutor(1, "commopt-diloco")
            weakref.finalize(self, _close, self._executor, closer)

    def settings(self) -> dict[str, int]:
        """Every setting the ranks (and a checkpoint) must agree on, as integers."""
        return {
            "sync_every": self.sync_every,
            "compression": COMPRESSIONS.index(self.compression),
            "fragments": self.fragments,
            "delay": self.delay,
            "warmup_steps": self.warmup_steps,
            "fp32_syncs": self.fp32_syncs,
            "topology": int(self.topology == "hierarchical"),
            "scale per tensor": int(self.scale == "tensor"),
            "outer_lr": float_bits(self.outer_lr),
            "outer_momentum": float_bits(self.outer_momentum),
            "nesterov": int(self.nesterov),
            "parameter tensors": len(self._params),
            "parameter elements": sum(p.numel() for p in self._params),
        }

    def _build_average(self, node_topology: Any) -> PseudoGradientAverage:
        if self.compression == "onebit":
            kw = {"node_topology": node_topology} if node_topology is not None else {}
            return OnebitAverage(build_exchange(self.backend, self.topology, **kw))
        return (Fp32Average if self.compression == "none" else Bf16Average)(self.backend)

    # -- the torch.optim face ---------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's parameter groups."""
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        """The inner optimizer's per-parameter state."""
        return self.inner.state

    @property
    def defaults(self) -> dict[str, Any]:
        """The inner optimizer's defaults (read by frameworks that type an optimizer by its
        attributes, as Lightning's ``Optimizable``)."""
        return self.inner.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad``."""
        self.inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: the anchors, fragments and error buffers are laid out over the parameters
        DiLoCo was built with.

        Raises:
            ValueError: always; add the group to the inner optimizer before building DiLoCo.
        """
        raise ValueError(
            "DiLoCo syncs the parameters its inner optimizer held when DiLoCo was built; add the "
            "parameter group to the inner optimizer first, then build DiLoCo"
        )

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """One inner step; then, on the fragments' sync steps, the outer step (module
        docstring). Collective on sync steps (and on every step during warmup, or with
        ``topology="hierarchical"``).

        Raises:
            NonFiniteError: some rank's pseudo-gradient holds inf/NaN; raised on every rank
                with the anchor, the outer momentum and the error buffers unchanged (the
                parameters keep their non-finite values: resume from a checkpoint).
            ValueError: the inner optimizer holds parameters other than those DiLoCo was
                built with (a group added to it directly), before its inner step; or, on
                every rank, when a sync or an averaging step finds the ranks at
                different steps (one ran out of data and is in :meth:`finish`).
        """
        notify(self)  # this rank still has data (inside torch's Join; commopt.join)
        self._check_parameters()
        t = self.progress.step + 1
        level = self.backend if t <= self.warmup_steps else self._node_backend
        if getattr(self, "found_inf", None) is not None:  # inside GradScaler.step (below)
            loss = self._scaled_inner_step(level)
        elif level is not None and closure is not None:
            user_closure = closure

            def closure() -> Any:
                loss = user_closure()
                self._average_gradients(level)
                return loss
        else:
            if level is not None:
                self._average_gradients(level)
            loss = step_inner(self.inner, closure)
        self._advance(t)
        return loss

    @torch.compiler.disable
    def _check_parameters(self) -> None:
        # a group added to the inner optimizer directly would train but never sync: the
        # replicas would drift apart without a word
        now = [p for g in self.inner.param_groups for p in g["params"]]
        moved = len(now) != len(self._params)
        if moved or any(a is not b for a, b in zip(now, self._params, strict=True)):
            raise ValueError(
                f"DiLoCo syncs the {len(self._params)} parameter tensors its inner optimizer held "
                f"when DiLoCo was built; the inner optimizer now holds {len(now)}, not all of "
                "them those (inner.add_param_group?), and DiLoCo would never sync the new ones. "
                "Build DiLoCo after the last group is added (a frozen parameter is synced too: "
                "unfreeze it later with requires_grad_)"
            )

    # Under torch.compile(opt.step) dynamo compiles the inner step, as it would the inner
    # optimizer's own; what follows communicates (and calls numba): it runs eagerly.
    @torch.compiler.disable
    def _advance(self, t: int) -> None:
        """Inner step t taken: count it, and start and apply the syncs it completes."""
        self.progress.step = t
        if t == self.warmup_steps:
            for frag in self.parts:  # identical on every rank after averaged steps
                frag.gather_params_(frag.anchor)
        for p, (future, apply_at) in list(self.progress.pending.items()):
            if apply_at == t:
                del self.progress.pending[p]
                self._apply(p, future.result())
        for p in self._due(t):
            self._start(p, t)

    # GradScaler.step(opt) then calls step() on every rank, even one that found an inf (which
    # would otherwise miss its sync): the inner step is skipped there instead (inner.py)
    _step_supports_amp_scaling = True

    # torch's Joinable protocol: Join([optimizer]) on uneven inputs (commopt.join)
    join_hook = shadow_without_gradients
    join_device = JOIN_DEVICE
    join_process_group = JOIN_PROCESS_GROUP

    @torch.compiler.disable
    def _scaled_inner_step(self, level: Backend | None) -> Any:
        """The inner step under ``GradScaler.step`` (:func:`~commopt.diloco.inner.
        scaled_step_inner`), gradients averaged over ``level`` first where there is one."""
        average = None if level is None else functools.partial(self._average_gradients, level)
        scale = getattr(self, "grad_scale", None)
        loss, skipped = scaled_step_inner(self.inner, self._params, scale, self.found_inf, average)
        self.progress.skipped += int(skipped)
        return loss

    def _due(self, t: int) -> list[int]:
        s = t - self.warmup_steps
        return [p for p, o in enumerate(self._offsets) if s >= o and (s - o) % self.sync_every == 0]

    def _start(self, p: int, t: int) -> None:
        # first, every rank is here at step t: one that ran out of data is in finish(), and
        # both raise instead of pairing this sync's collectives with its check
        fp32 = self._in_fp32(p, t)
        sent = agree_on_steps(self.backend, t, f"DiLoCo's sync after inner step {t}")
        self.progress.bytes["sync"] += sent
        self.progress.bytes["fp32"] += sent if fp32 else 0
        frag = self.parts[p]
        self.progress.last_sync[p] = t
        frag.pseudo_gradient()
        if not self._lockstep_checked:
            self._lockstep_checked = True
            # islands' ranks share their node's steps by design; across nodes they must differ
            if self.topology != "hierarchical":
                warn_if_in_lockstep(self.backend, frag.delta)
        if self._executor is None:
            self._apply(p, self._average(frag, fp32))
            return
        future = self._executor.submit(self._average_on_channel, frag, fp32)
        self.progress.pending[p] = (future, t + self.delay)

    def _in_fp32(self, p: int, t: int) -> bool:
        """Whether fragment p's sync after inner step t is one of its first ``fp32_syncs``."""
        return t - self.warmup_steps - self._offsets[p] < self.fp32_syncs * self.sync_every

    def _average_on_channel(self, frag: Fragment, fp32: bool) -> torch.Tensor:
        with on_channel(self._channel):
            return self._average(frag, fp32)

    def _average(self, frag: Fragment, fp32: bool) -> torch.Tensor:
        average = self._fp32 if fp32 else self.average
        before = {k: b.stats.snapshot() for k, b in average.backends.items()}
        if fp32:
            average.average_(frag.delta, {})
        else:
            if len(frag.segments) > 1:  # every rank agrees on finiteness before any moves
                check_finite(self.backend, frag.delta)
            for (offset, numel), state in zip(frag.segments, frag.states, strict=True):
                average.average_(frag.delta[offset : offset + numel], state)
        for level, b in average.backends.items():
            sent = (b.stats.snapshot() - before[level]).bytes_sent
            self.progress.bytes["local" if level == "local" else "sync"] += sent
            if fp32:
                self.progress.bytes["fp32"] += sent
        self.progress.syncs += 1
        self.progress.fp32_syncs_run += int(fp32)
        return frag.delta

    def _apply(self, p: int, average: torch.Tensor) -> None:
        self.parts[p].outer_step_(average, self.outer_lr, self.outer_momentum, self.nesterov)

    @torch.compiler.disable
    def _average_gradients(self, backend: Backend, nonfinite: bool = False) -> bool:
        step = self.progress.step + 1
        sent, nonfinite = average_gradients_(backend, self._params, step, nonfinite)
        self.progress.bytes["warmup" if backend is self.backend else "local"] += sent
        return nonfinite

    @contextlib.contextmanager
    def synced_weights(self) -> Iterator[None]:
        """Inside the block, the parameters are the anchors θ̄: the model of the last sync, the
        same on every rank, to evaluate or save while training goes on. After it, each rank's
        own parameters are back, bit for bit, and nothing else has changed. Not collective.
        During warmup the ranks' parameters are one model already and are left as they are; a
        fragment whose sync is still in flight (``delay``) shows the anchor before that sync.

        Example::

            with opt.synced_weights():
                val_loss = evaluate(model)
        """
        if self.progress.step <= self.warmup_steps:
            yield
            return
        own = [frag.gather_params_(torch.empty_like(frag.anchor)) for frag in self.parts]
        try:
            for frag in self.parts:
                frag.load_params_()
            yield
        finally:
            for frag, mine in zip(self.parts, own, strict=True):
                frag.load_params_(mine)

    def finish(self, buffers: Iterable[torch.Tensor] = ()) -> None:
        """End of training: apply every delayed sync now, then sync every fragment that has
        taken inner steps since its last sync (collective). Afterwards all synced parameters
        are bit-identical on every rank: the one model to evaluate and keep. Floating-point
        ``buffers`` (``model.buffers()``: BatchNorm's running statistics) are averaged too.

        Raises:
            ValueError: on every rank, when the ranks took different numbers of inner steps
                (the ranks behind would wait for ever in a sync the others never enter), or
                passed buffers of different sizes.
        """
        # A delayed sync still in flight was started by every rank (after its step check), and
        # may share this backend's communicator (no channel on a sub-group: FSDP2's replicate
        # group): it completes before anything else goes over it.
        for p, (future, _) in sorted(self.progress.pending.items()):
            del self.progress.pending[p]
            self._apply(p, future.result())
        floats = [local_shard(b) for b in buffers if b.is_floating_point()]
        step, node = self.progress.step, self._node_backend
        if node is not None and step >= self.warmup_steps:  # islands average on the node
            self.progress.bytes["local"] += agree_on_steps(node, step, "DiLoCo.finish()")
        self.progress.bytes["sync"] += agree_on_steps(self.backend, step, "DiLoCo.finish()", floats)
        self.progress.bytes["sync"] += average_buffers_(self.backend, floats)
        if self.progress.step <= self.warmup_steps:
            return  # still data parallel: identical already
        for p, frag in enumerate(self.parts):
            if self.progress.last_sync[p] != self.progress.step:
                self.progress.last_sync[p] = self.progress.step
                frag.pseudo_gradient()
                self._apply(p, self._average(frag, self._in_fp32(p, self.progress.step)))

    # -- observability and checkpoints ------------------------------------------------------------
    def comm_stats(self) -> dict[str, Any]:
        """What this rank sent (modelled bytes, SPEC §7's cost model).

        ``steps``: inner steps counted, ``skipped_steps`` of them skipped on this rank for an
        inf/NaN gradient under ``GradScaler``; ``syncs``: fragment averages run,
        ``syncs_at_fp32`` of them by ``fp32_syncs``;
        ``bytes_sent``: the syncs and the warmup on the global (or cross-node) level, of which
        ``sync_bytes`` the syncs and ``fp32_sync_bytes`` the first ``fp32_syncs`` of them;
        ``local_bytes``: inside the node (``topology="hierarchical"``);
        ``bits_per_parameter_per_step``: 8·``bytes_sent`` / (synced elements · inner steps), the
        whole run's rate; ``compressed_bits_per_parameter_per_step``: the rate once the warmup
        and the fp32 syncs are over (the steps after W + K·H), the syncs in ``compression``
        only: what the per-step bound 2/H of ``"onebit"`` is about, as 1-bit Adam's 2 bits per
        parameter are its compression stage's.
        """
        numel = sum(f.numel for f in self.parts)
        per = max(1, numel)  # (parameters of no elements: the rates are 0, not a ZeroDivisionError)
        sent = self.progress.bytes["sync"] + self.progress.bytes["warmup"]
        compressed = self.progress.bytes["sync"] - self.progress.bytes["fp32"]
        stage = self.progress.step - self.warmup_steps - self.fp32_syncs * self.sync_every
        return {
            "steps": self.progress.step,
            "skipped_steps": self.progress.skipped,
            "syncs": self.progress.syncs,
            "syncs_at_fp32": self.progress.fp32_syncs_run,
            "parameters": numel,
            "bytes_sent": sent,
            "sync_bytes": self.progress.bytes["sync"],
            "fp32_sync_bytes": self.progress.bytes["fp32"],
            "warmup_bytes": self.progress.bytes["warmup"],
            "local_bytes": self.progress.bytes["local"],
            "bits_per_parameter_per_step": 8 * sent / (per * max(1, self.progress.step)),
            "compressed_bits_per_parameter_per_step": 8 * compressed / (per * max(1, stage)),
        }

    def state_dict(self) -> dict[str, Any]:
        """The inner state, each synced parameter's anchor (and outer momentum), and in
        ``"commopt"`` this rank's error buffers, the step and any delayed sync in flight
        (:mod:`commopt.diloco.checkpointing`; with :func:`commopt.save_checkpoint` the anchors
        are written once and the error buffers per rank)."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = checkpointing.state_dict(self._parts())
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            state_dict = post_hook(self, state_dict) or state_dict
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; everything is checked before anything changes."""
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre_hook(self, state_dict) or state_dict
        checkpointing.load_state_dict(self._parts(), state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def __getstate__(self) -> dict[str, Any]:
        """Refused (``TypeError``): torch's pickling keeps only the parameter groups and the
        state, and would give an object without the backend, anchors and error buffers."""
        raise TypeError(
            "DiLoCo cannot be pickled or deep-copied (it holds its backend's process groups and "
            "a communication thread); save opt.state_dict() and load it into a new DiLoCo"
        )

    def _parts(self) -> checkpointing.Parts:
        inner, be, average, progress = self.inner, self.backend, self.average, self.progress
        return checkpointing.Parts(inner, be, average, self.parts, progress, self.settings())

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(self.config).items())
        return f"{type(self).__name__}({type(self.inner).__name__}, {settings})"


def _close(executor: concurrent.futures.ThreadPoolExecutor, closer: Any) -> None:
    executor.shutdown(wait=True)
    if closer is not None:
        closer()
