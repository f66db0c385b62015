"""torch's ``TestOptimRenewed``, ported (``tests/torch_optim_port.py``), on 2 gloo ranks: the
bodies where communication matters (state dicts, schedulers, per-group options, hooks, a layer
frozen and unfrozen), each rank with its own data, so every step of the short schedule goes
through the 1-bit exchange, standalone and with ``overlap=True``. Besides each body's own
assertions, the replicas hold the same parameters at the end of each run (``RankWorld.agree``).

Each optimizer's bodies run in one pair of forked ranks (a few seconds); the results are kept
per case, so each case passes or fails on its own.
"""

from __future__ import annotations

import functools
import traceback

import pytest
import torch
import torch.distributed as dist

from tests.multirank.harness import run_ranks
from tests.optim_registry import BY_NAME
from tests.torch_optim_port import BODIES, SHORT, Entry, World, cases

#: each optimizer with its short schedule, standalone and with overlap=True (its communication
#: started by gradient hooks, on a thread: the bodies build one optimizer after another over the
#: same parameters, which is how a hook left on an older optimizer was found)
ON_TWO_RANKS = (
    *SHORT,
    *(Entry(f"{e.name}-overlap", e.cls, {**e.base, "overlap": True}) for e in SHORT),
)

#: the bodies where communication matters (the others are the unit suite's)
ON_RANKS = (
    "test_forloop_goes_right_direction",
    "test_param_group_with_lrscheduler_goes_right_direction",
    "test_foreach_matches_forloop",
    "test_param_groups_weight_decay",
    "test_param_groups_lr",
    "test_step_is_noop_for_zero_grads",
    "test_state_dict_deterministic",
    "test_can_load_older_state_dict",
    "test_can_load_from_to_named_state_dict",
    "test_save_load_equality_with_weights_only",
    "test_load_nontensor_step",
    "test_load_state_dict_pre_post_hook",
    "test_step_all_hooks",
    "test_deepcopy_copies_all_public_attrs",
)
#: combinations that do not touch communication run in the unit suite only (layout, names)
ONE_PROCESS_ONLY = (
    {"contiguous": False},
    {"is_named_optim0": True, "is_named_optim1": False},
    {"is_named_optim0": False, "is_named_optim1": True},
    {"is_named_optim": True},
)
CASES = [
    (name, kw)
    for name, kw in cases()
    if name in ON_RANKS and not any(only.items() <= kw.items() for only in ONE_PROCESS_ONLY)
]


def case_id(name: str, kwargs: dict) -> str:
    return name + "".join(f"-{k}={v}" for k, v in kwargs.items())


class RankWorld(World):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def mean(self, loss) -> float:
        total = torch.tensor([float(loss)], dtype=torch.float64)
        dist.all_reduce(total)
        return total.item() / dist.get_world_size()

    def agree(self, entry: Entry, optimizer, params) -> None:
        shared = BY_NAME[entry.name.removesuffix("-overlap")].shared(optimizer, params)
        gathered = [torch.empty_like(shared) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, shared)
        assert all(torch.equal(g, gathered[0]) for g in gathered), "replicas differ"


def _all_bodies(backend, entry_name: str) -> dict[str, str | None]:
    entry = next(e for e in ON_TWO_RANKS if e.name == entry_name)
    world = RankWorld(backend.rank)
    failures: dict[str, str | None] = {}
    first = None
    for name, kwargs in CASES:
        if first is not None:  # the ranks may be out of step now: run nothing more
            failures[case_id(name, kwargs)] = f"not run: {first} failed before it"
            continue
        try:
            BODIES[name][0](entry, world, **kwargs)
            failures[case_id(name, kwargs)] = None
        except Exception:
            failures[case_id(name, kwargs)] = traceback.format_exc(limit=-3)
            first = case_id(name, kwargs)
    return failures


@functools.cache
def _results(entry_name: str) -> list[dict[str, str | None]]:
    return run_ranks(_all_bodies, 2, entry_name, timeout=240)


@pytest.mark.parametrize("entry", [e.name for e in ON_TWO_RANKS])
@pytest.mark.parametrize("case", [case_id(n, kw) for n, kw in CASES])
def test_ported_on_two_ranks(case, entry):
    for rank, failures in enumerate(_results(entry)):
        assert failures[case] is None, f"rank {rank}: {failures[case]}"
