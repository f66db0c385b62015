r"""A DDP communication hook that lets a commopt optimizer train a DistributedDataParallel model.

Every framework that trains data-parallel (the HF Trainer, accelerate, Lightning) wraps the
model in :class:`~torch.nn.parallel.DistributedDataParallel`, and DDP averages every gradient
during backward. A commopt optimizer must not see averaged gradients in its compression
stage: 1-bit Adam folds each rank's *local* gradient into the momentum and averages the
momentum at one bit. DDP's answer to custom communication is a communication hook (torch's
``powerSGD_hook`` is one): DDP hands it each gradient bucket as soon as backward has filled it
and uses whatever tensor the hook's future returns as the bucket's gradients. DDP then brings
its bucketing, its overlap with backward, ``no_sync()`` and every framework's integration.

Usage::

    model = DistributedDataParallel(model)
    optimizer = commopt.OnebitAdam(model.parameters(), freeze_step=1000)
    model.register_comm_hook(commopt.ddp.OnebitHookState(optimizer), commopt.ddp.onebit_hook)
    # the training loop is unchanged: backward, optimizer.step(), zero_grad

:func:`register_hook` does that line, and registers torch's ``noop_hook`` for a
:class:`~commopt.DiLoCo` instead.

What the hook does with a bucket depends on what the optimizer's next step does with each
parameter (the algorithm's :class:`~commopt.optim._early.EarlyPlan`):

1. **average** (1-bit Adam's and 1-bit LAMB's warmup, 0/1 Adam's variance steps): the bucket's
   gradients are copied into the optimizer's bucket layout, and as soon as an optimizer bucket
   is complete its full-precision average starts, asynchronously; DDP's bucket gets the
   averaged values back. The optimizer then uses them without averaging again. Averaging the
   optimizer's buckets, not DDP's, keeps the reduction order of the standalone optimizer, so
   the result is bit-identical to it at any world size. Parameters the optimizer does not own
   get DDP's own average, on DDP's layout.
2. **momentum** (1-bit Adam's compression stage): m' = β1·m + (1−β1)·g is computed from the
   bucket's local gradients into a staged momentum, and as soon as every parameter of one of
   the *optimizer's* buckets has been folded, that bucket's compressed exchange runs, on
   staged error buffers (:mod:`commopt.optim._early`). ``step()`` commits both when every rank
   agrees that the step is taken, and drops them when it is skipped (a non-finite gradient on
   any rank). Because the exchange works on the optimizer's buckets, not DDP's, the result is
   bit-identical to the standalone optimizer however DDP buckets the model, and the error
   buffers stay in the optimizer's ``state_dict()``. The gradients DDP leaves in ``p.grad``
   are the local ones.
   1-bit LAMB's compression stage is the same fold, its exchange scaled by σ around it.
3. **gradient** (0/1 Adam's 1-bit steps): the local gradient itself is copied into the staged
   buffer and exchanged at one bit, on staged error buffers, as in 2.
4. **nothing** (0/1 Adam's phase B: local steps send nothing, sync steps depend on ``lr`` as
   ``step()`` reads it, docs/ddp.md): the bucket's gradients stay local, and ``step()``
   communicates, exactly as without DDP.

Semantics to know:

- **Gradient accumulation**: use DDP's ``no_sync()`` for every backward pass but the last
  before ``step()`` (the HF Trainer and accelerate do); those passes communicate nothing. A
  second synced backward before ``step()`` is allowed but communicates again, as with DDP, and
  the last one wins (its momentum is folded anew from the committed state).
- **Gradient clipping** after backward (``clip_grad_norm_``) acts on averaged gradients in the
  warmup, as with DDP. In the compression stage the local gradient has already been folded
  into the momentum when backward returns; ``step()`` sees that ``p.grad`` (or β1) changed
  since and redoes the step as the standalone optimizer would, from ``p.grad`` (the same bits;
  the communication paid twice in that step; :class:`commopt.optim._early._work.EarlyReads`).
- **GradScaler** (fp16 loss scaling) cannot be combined with the compression stage: the
  gradient is folded before the scaler unscales it; ``step()`` raises. bf16 autocast needs no
  scaler and works.
- Checkpoints: save the optimizer's ``state_dict()`` as usual; it holds the error buffers. The
  hook state holds nothing to save.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at run time
# (``bucket: dist.GradBucket``, ``-> torch.futures.Future[torch.Tensor]``).
import functools
import logging
from typing import Any

import torch
import torch.distributed as dist

from commopt.comm import all_reduce_async
from commopt.comm.handoff import completed_future, device_future
from commopt.join import in_backward, in_join, set_gradients_as_ddp
from commopt.optim._early import Kind
from commopt.optim._early._work import after_ddp_backward
from commopt.optim.base import CompressedOptimizer

__all__ = ["OnebitHookState", "onebit_hook", "register_hook"]

logger = logging.getLogger(__name__)


class OnebitHookState:
    r"""What :func:`onebit_hook` needs: the commopt optimizer that consumes the gradients.

    The hook itself is stateless; everything it changes lives in the optimizer (staged until
    ``step()``), so this object only pairs the two. It is built from the optimizer *after* DDP
    has wrapped the model (the optimizer must hold the DDP model's parameter tensors).

    Tuning (the knobs are DDP's and the optimizer's, not this object's):

    1. ``freeze_step`` (the optimizer's) decides when the hook switches from full-precision
       averages to 1-bit momentum; see :class:`commopt.OnebitAdam`.
    2. DDP's ``bucket_cap_mb`` (default 25) sets the granularity of the warmup's averages, as
       with DDP alone: smaller buckets start communicating earlier in backward, larger ones
       pay less latency per byte. It does not change any result.
    3. The compressed exchange of an optimizer bucket starts when its last gradient has been
       folded. commopt's buckets follow the order of ``param_groups`` (forward order) and hold
       up to 2**25 elements, so for most models there is one, exchanged at the end of
       backward. Its result is the same whatever DDP's buckets are.
    4. ``gradient_as_bucket_view=True`` saves DDP one gradient-sized copy and changes nothing
       here. ``find_unused_parameters=True`` works and gives the standalone optimizer's
       results: a parameter a rank did not use arrives with a zero gradient, which is what the
       standalone optimizer makes of a missing gradient in a step that communicates; in 0/1
       Adam's local steps, where it would see ``None`` and leave the parameter alone, the hook
       restores ``p.grad = None`` once DDP has finished.

    Memory: in the compression stage, per optimizer bucket, a staged momentum and staged error
    buffers, about (2 + 1/n)·4 bytes per parameter for n ranks (:mod:`commopt.optim._early`).

    Args:
        optimizer: a commopt optimizer (:class:`~commopt.OnebitAdam`,
            :class:`~commopt.OnebitLamb`, :class:`~commopt.ZeroOneAdam`) over the DDP model's
            parameters.
        exchange_in_backward: in the compression stage (and 0/1 Adam's 1-bit steps), fold the
            local gradient and run the 1-bit exchange during backward, overlapped with it.
            ``False``: leave the local gradients to ``step()``, which compresses them as the
            standalone optimizer does; the warmup's averages still run in backward. ``None``
            (default): ``True`` where the optimizer's parameters are on a CUDA device, ``False``
            elsewhere. The in-backward exchange stages the error buffers and the momentum
            (three extra memory passes per step), which only pays when backward is long next
            to the exchange, as it can be on GPU nodes (not measured yet); on CPU-bound hosts
            ``False`` with DDP's ``gradient_as_bucket_view=True`` came within 1.04× of the
            standalone optimizer, against 1.25× (docs/performance.md, "The DDP hook against
            the standalone optimizer"). The results are the same bits either way.

    Raises:
        TypeError: ``optimizer`` is not a commopt optimizer.
    """

    __slots__ = ("exchange_in_backward", "optimizer")

    def __init__(
        self, optimizer: CompressedOptimizer, exchange_in_backward: bool | None = None
    ) -> None:
        if not isinstance(optimizer, CompressedOptimizer):
            raise TypeError(
                f"OnebitHookState needs a commopt optimizer (OnebitAdam, OnebitLamb, "
                f"ZeroOneAdam), got {type(optimizer).__name__}; for a plain torch optimizer keep "
                "DDP's default hook"
            )
        if optimizer.overlap:
            raise ValueError(
                f"{type(optimizer).__name__} was built with overlap=True, which starts its "
                "communication from gradient hooks; under DDP the commopt hook does that: build "
                "the optimizer with overlap=False"
            )
        # The optimizer owns every buffer the hook touches: its flat moments, its exchange's
        # error buffers and the work staged for the next step. Keeping them there (not here,
        # per DDP bucket) is what makes the hook's results the standalone optimizer's.
        self.optimizer: CompressedOptimizer | None = optimizer
        if exchange_in_backward is None:
            exchange_in_backward = any(
                p.is_cuda for group in optimizer.param_groups for p in group["params"]
            )
        if not isinstance(exchange_in_backward, bool):
            raise TypeError(
                f"exchange_in_backward must be True, False or None, got {exchange_in_backward!r}"
            )
        #: Resolved: whether the compression stage's exchange runs in backward.
        self.exchange_in_backward: bool = exchange_in_backward

    def __getstate__(self) -> dict[str, Any]:
        # Pickling a DDP model pickles its hook state; the optimizer is saved on its own
        # (state_dict), so it is left out here and must be re-attached.
        logger.info("OnebitHookState: the optimizer is not pickled; set state.optimizer again")
        return {"exchange_in_backward": self.exchange_in_backward}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.optimizer = None
        self.exchange_in_backward = state.get("exchange_in_backward", True)


def _forget_grads(params: list[torch.Tensor]) -> None:
    for p in params:
        p.grad = None


@torch.no_grad()
def onebit_hook(
    state: OnebitHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook for commopt optimizers (see the module docstring).

    1. Ask the optimizer what its next step does with each parameter of the bucket.
    2. Fold the local gradients of the "momentum" parameters into their staged momentum
       (copy those of the "gradient" parameters into the same staged buffer); an optimizer
       bucket whose parameters are now all folded is exchanged at one bit.
    3. Stage the gradients of the "average" parameters in their optimizer buckets; start the
       average of every optimizer bucket now complete (at DDP's last bucket: of every one
       begun). Average the parameters this optimizer does not own on DDP's layout.
    4. The future completes when those averages have: it copies them into DDP's bucket.
       Parameters left local ("momentum", or steps that communicate in ``step()``) keep
       their local gradient.

    Example::

        >>> # xdoctest: +SKIP
        >>> ddp_model.register_comm_hook(OnebitHookState(optimizer), onebit_hook)
    """
    opt = state.optimizer
    if opt is None:
        raise RuntimeError(
            "OnebitHookState has no optimizer (it was unpickled); set state.optimizer"
        )
    shadow = not in_backward()  # a joined rank: DDP's join hook shadows a backward
    if shadow and not in_join(opt):
        raise RuntimeError(
            "commopt.ddp.onebit_hook ran outside backward: this rank has joined (it ran out of "
            "data inside DDP's join(), or a Join given the model alone), and DDP shadows its own "
            "collectives only; the optimizer communicates in step() too. Give torch's Join the "
            "optimizer as well: `with Join([model, optimizer]):` (docs/ddp.md)"
        )
    work = opt.early_work
    if not state.exchange_in_backward:
        work.decline()  # (every call: a loaded state dict builds the early work anew)
    buffer = bucket.buffer()
    params = bucket.parameters()
    slices, start = [], 0
    for p in params:
        slices.append(slice(start, start + p.numel()))
        start += p.numel()
    # 1.
    kinds = work.plan(params)
    # A parameter this rank did not use (find_unused_parameters=True) has no p.grad yet; DDP
    # will write zeros there. Where the gradient stays local (0/1 Adam's local steps) the
    # standalone optimizer would see None and leave the parameter alone: restore that.
    unused = [p for p, k in zip(params, kinds, strict=True) if k is None and p.grad is None]
    if unused:
        after_ddp_backward(functools.partial(_forget_grads, unused))
    # 2.
    fold = [i for i, k in enumerate(kinds) if k in (Kind.MOMENTUM, Kind.GRADIENT)]
    if fold:
        work.fold([params[i] for i in fold], [buffer[slices[i]] for i in fold])
    # 3.
    average = [i for i, k in enumerate(kinds) if k == Kind.AVERAGE]
    owned = [i for i in average if work.locate(params[i]) is not None]
    foreign = [i for i in average if work.locate(params[i]) is None]
    pending: list[tuple[torch.futures.Future[torch.Tensor], list[tuple[slice, int, int]]]] = []
    if owned:
        started = work.average(
            [params[i] for i in owned], [buffer[slices[i]] for i in owned], bucket.is_last()
        )
        for fut, spans in started:
            pending.append((fut, [(slices[owned[k]], at, numel) for k, at, numel in spans]))
    if foreign:  # not this optimizer's: DDP's own average, on DDP's bucket layout
        copy = buffer.to(torch.float32, copy=True)
        fut = all_reduce_async(opt.backend, copy, "avg")
        pending.append((fut, [(slices[i], slices[i].start, params[i].numel()) for i in foreign]))
    # 4.
    done = _finished(buffer, pending) if pending else completed_future(buffer)
    if not shadow:
        return done

    def write(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        # DDP writes no p.grad on a joined rank: write what it writes on a rank with data
        out = fut.value()
        grads = [out[where].view_as(p).clone() for p, where in zip(params, slices, strict=True)]
        set_gradients_as_ddp(params, grads)
        return out

    return done.then(write)


def _finished(
    buffer: torch.Tensor,
    pending: list[tuple[torch.futures.Future[torch.Tensor], list[tuple[slice, int, int]]]],
) -> torch.futures.Future[torch.Tensor]:
    """The bucket, once every average in ``pending`` is copied into it. DDP waits on the
    result and reads the bucket on its stream: each average is waited for on the stream that
    copies it, and the result records that stream (comm.handoff)."""
    result = device_future(buffer.device)

    def finish(fut: torch.futures.Future[Any]) -> None:
        del fut
        try:
            for done, spans in pending:
                averaged = done.wait()
                for where, at, numel in spans:
                    buffer[where].copy_(averaged[at : at + numel])
        except Exception as err:  # DDP waits on ``result``: never leave it pending
            result.set_exception(err)
            return
        result.set_result(buffer)

    torch.futures.collect_all([f for f, _ in pending]).add_done_callback(finish)
    return result


def register_hook(
    model: torch.nn.parallel.DistributedDataParallel,
    optimizer: Any,
    exchange_in_backward: bool | None = None,
) -> OnebitHookState | None:
    """Register the hook ``optimizer`` needs on the DDP ``model``: :func:`onebit_hook` paired
    with a commopt optimizer, or torch's ``noop_hook`` for a :class:`~commopt.DiLoCo`, whose
    inner steps must keep each rank's own gradients (it averages the pseudo-gradient itself).

    Args:
        model: the DistributedDataParallel model (the framework's wrapper, once it exists).
        optimizer: the commopt optimizer or DiLoCo you built (not a framework's wrapper of it).
        exchange_in_backward: passed to :class:`OnebitHookState`.

    Returns:
        The hook's state, or None for DiLoCo.

    Raises:
        TypeError: ``model`` is not DistributedDataParallel, or ``optimizer`` is neither.

    The optimizer's parameters are also added to DDP's ``parameters_to_ignore``, which DDP
    reads after construction only where torch's ``Join`` ends (docs/ddp.md, "Uneven inputs"):
    there DDP broadcasts the last joiner's parameters to every rank, and the optimizer keeps its
    replicas itself (0/1 Adam's and DiLoCo's differ between syncs, by design).
    """
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

    from commopt.diloco import DiLoCo

    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"register_hook needs a DistributedDataParallel model, got {type(model).__name__}"
        )
    if not isinstance(optimizer, (DiLoCo, CompressedOptimizer)):
        raise TypeError(
            f"register_hook needs a commopt optimizer or DiLoCo, got {type(optimizer).__name__} "
            "(pass the optimizer you built, not a framework's wrapper of it)"
        )
    mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    model.parameters_to_ignore.update(
        name for name, p in model.module.named_parameters() if id(p) in mine
    )
    if isinstance(optimizer, DiLoCo):
        model.register_comm_hook(None, noop_hook)
        return None
    state = OnebitHookState(optimizer, exchange_in_backward)
    model.register_comm_hook(state, onebit_hook)
    return state
