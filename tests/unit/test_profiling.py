"""The profilers in experiments/ read a step's phases from a cProfile by the qualified names of
the functions that do them (experiments.harness.profiling); a refactor that renames or stops
calling one of them must fail here, not print a silent ``-`` when someone runs the profile."""

from __future__ import annotations

import cProfile

import torch

import commopt
import commopt.pipelined
from experiments.harness.profiling import defined_names, inclusive_times
from experiments.optim import ddp_check_cost, profile_step
from tests.multirank.harness import run_ranks

NAMES = [n for _, n in profile_step.PHASES] + [ddp_check_cost.DIGEST]


def test_every_name_read_from_a_profile_is_a_function_in_the_source() -> None:
    assert [n for n in NAMES if not n.startswith("<") and n not in defined_names()] == []


def _profiled_steps(backend: commopt.Backend, pipelined: bool) -> set[str]:
    if pipelined:  # staged server kernels, as the profiled run's 25M elements get (6 stages);
        commopt.pipelined.MIN_STAGE = 1 << 10  # a forked rank: the constant changes there only
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(64, 64), (64,)]]
    opt = commopt.OnebitAdam(params, freeze_step=2, backend=backend)
    found: set[str] = set()
    for _ in range(4):  # 2 warmup steps (the first digests the gradients), then compressed ones
        for p in params:
            p.grad = torch.randn(p.shape)
        profile = cProfile.Profile()
        profile.enable()
        opt.step()
        profile.disable()
        found |= set(inclusive_times(profile, NAMES))
    return found


def test_the_steps_call_every_function_the_profilers_name() -> None:
    found = set().union(*run_ranks(_profiled_steps, 2, False), *run_ranks(_profiled_steps, 2, True))
    assert found == set(NAMES)
