"""Shared pieces of the experiments: starting ranks, the optimizer variants, their traffic."""

from experiments.common.training import (
    ALL_VARIANTS,
    AllReduceCounter,
    Hyper,
    Setup,
    describe_machine,
    is_variant,
    launch,
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
    "sum_over_ranks",
    "train_on_task",
]
