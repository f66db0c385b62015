"""The experiments' harness: the one rank launcher (:mod:`.ranks`, which the tests use too),
the optimizer variants and their training loop, their traffic (:mod:`.training`), the
convergence tasks (:mod:`.tasks`: the byte-level GPT, the digits CNN) and the small problems of
the LAMB and 0/1 Adam checks (:mod:`.small_tasks`), profiles (:mod:`.profiling`)."""

from experiments.harness.ranks import launch, run_ranks
from experiments.harness.training import (
    ALL_VARIANTS,
    AllReduceCounter,
    Hyper,
    Setup,
    describe_machine,
    is_variant,
    make_setup,
    rank_and_size,
    replicas_identical,
    sum_over_ranks,
    train_on_task,
)

__all__ = [
    "ALL_VARIANTS",
    "AllReduceCounter",
    "Hyper",
    "Setup",
    "describe_machine",
    "is_variant",
    "launch",
    "make_setup",
    "rank_and_size",
    "replicas_identical",
    "run_ranks",
    "sum_over_ranks",
    "train_on_task",
]
