r"""SPEC §1 over all ranks (:class:`FlatExchange`), and what an exchange is (:class:`Exchange`)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from commopt.choices import ERROR_FEEDBACKS, ErrorFeedback, check_choice
from commopt.comm import Backend
from commopt.compressed import compressed_allreduce_and_scale, padded_size
from commopt.exchange.econtrol import econtrol_allreduce_
from commopt.pipelined import check_stages

__all__ = ["Exchange", "FlatExchange"]


@runtime_checkable
class Exchange(Protocol):
    """The contract between an optimizer and a compressed average.

    ``name`` identifies the exchange and its layout in checkpoints: buffers saved under one name
    are restored only into an exchange of the same name and world size.
    """

    name: str
    backend: Backend

    def state_numels(self, numel: int) -> dict[str, int]:
        """The per-rank fp32 buffers (name → element count) for a buffer of ``numel`` elements."""
        ...

    def allreduce_(
        self, tensor: torch.Tensor, state: dict[str, torch.Tensor]
    ) -> torch.Tensor | None:
        """Replace ``tensor`` (1-D fp32) by its compressed average over all ranks, in place,
        updating ``state`` in place; bit-identical on every rank. Returns this rank's worker
        scale s (1-element fp32, for the compression-error diagnostic) or ``None`` when nothing
        was compressed. Raises ``NonFiniteError`` on every rank, with ``state`` untouched, when
        any rank's input is not finite."""
        ...


class FlatExchange:
    r"""SPEC §1: every rank is a worker for the whole buffer and the server of one chunk.

    Args:
        backend: where to communicate.
        feedback: the workers' error-feedback policy.

            - ``"classic"`` (default): SPEC §1 exactly; state ``worker_error``, ``server_error``.
            - ``"econtrol"``: EControl (Gao, Islamov, Stich, ICLR 2024, arXiv:2311.05645), see
              :func:`commopt.exchange.econtrol.econtrol_allreduce_`. The workers compress the
              difference between their buffer and an estimate of it, plus η times their error;
              the servers keep classic error feedback. Same wire bytes per call (plus one fp32
              all-reduce on the very first call); state adds ``worker_estimate`` and
              ``mean_estimate`` (N elements each) and ``started`` (1 element).
        eta: η of EControl, the strength of the worker error feedback (ignored by
            ``"classic"``). η = 1 feeds the whole error back as classic EF does; η → 0 turns
            the feedback off (EF21). The paper tunes it per problem; the default is from
            docs/algorithms/error_feedback.md's experiment.
        pipeline: stages of ``"classic"``'s steps 4–9 (:mod:`commopt.pipelined`; the same bits
            in any number); ``None`` (default): :func:`~commopt.pipelined.auto_stages`.
        layout: what the ranks' buffers belong to, the start of :attr:`name` (default
            ``"flat"``; between the replicas of sharded parameters, their layout
            ``"sharded:RxS:i.j"``, :mod:`commopt.sharding`).
    """

    def __init__(
        self,
        backend: Backend,
        feedback: ErrorFeedback = "classic",
        eta: float = 0.2,
        *,
        pipeline: int | None = None,
        layout: str = "flat",
    ) -> None:
        check_choice("feedback", feedback, ERROR_FEEDBACKS)
        if not 0.0 <= eta:  # also rejects NaN
            raise ValueError(f"Invalid eta: {eta} (must be >= 0)")
        self.pipeline = check_stages(pipeline)
        self.backend = backend
        self.feedback = feedback
        self.eta = float(eta)
        # The name keys the layout in checkpoints: EControl's buffers mean something else.
        self.name = layout if feedback == "classic" else f"{layout}-econtrol"

    def state_numels(self, numel: int) -> dict[str, int]:
        """Per-rank buffers for a bucket of ``numel``: the worker error (N), the server error
        (N/n)."""
        n = self.backend.world_size
        padded = padded_size(numel, n)
        sizes = {"worker_error": padded, "server_error": padded // n}
        if self.feedback == "econtrol":
            sizes.update(worker_estimate=padded, mean_estimate=padded, started=1)
        return sizes

    def allreduce_(
        self, tensor: torch.Tensor, state: dict[str, torch.Tensor]
    ) -> torch.Tensor | None:
        """flat ← C(flat) over all ranks (SPEC §1, or EControl's workers); returns the scale s."""
        if self.feedback == "econtrol":
            return econtrol_allreduce_(
                tensor,
                state["worker_error"],
                state["server_error"],
                state["worker_estimate"],
                state["mean_estimate"],
                state["started"],
                self.eta,
                self.backend,
            )
        _, s = compressed_allreduce_and_scale(
            tensor,
            state["worker_error"],
            state["server_error"],
            self.backend,
            out=tensor,
            pipeline=self.pipeline,
        )
        return s

    def __repr__(self) -> str:
        if self.feedback == "classic":
            return f"FlatExchange({self.backend!r})"
        return f"FlatExchange({self.backend!r}, feedback={self.feedback!r}, eta={self.eta})"
