"""torch 2.4's collectives only: the compressed exchange and all three optimizers on 4 forked
gloo ranks with every collective newer than torch 2.4 hidden from ``torch.distributed``
(``all_gather_single``, and ``all_gather_into_tensor``, whose gloo version is younger than some
supported releases): commopt/comm/torch_compat.py falls back to ``dist.all_gather`` into views.

The ranks are forked after the attributes are removed, so they run without them; each body
first checks that they are gone. The bodies and their oracles are the suites' own:
tests/multirank/test_compressed_gloo.py (against the float64 re-statement of SPEC §1),
test_onebit_adam_gloo.py (1-bit Adam against its re-statement), test_lamb_zero_one_gloo.py
(1-bit LAMB's and 0/1 Adam's schedules, collectives and replicas), and the device matrix
(every optimizer × mode bitwise equal to standalone, tests/device_matrix.py)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.device_matrix import check_matrix, run_matrix
from tests.multirank import test_compressed_gloo as compressed
from tests.multirank import test_lamb_zero_one_gloo as lamb_zero_one
from tests.multirank import test_onebit_adam_gloo as onebit_adam
from tests.multirank.harness import run_ranks

NEWER = ("all_gather_single", "all_gather_into_tensor")


@pytest.fixture(autouse=True)
def torch_2_4_collectives(monkeypatch):
    for name in NEWER:
        monkeypatch.delattr(dist, name, raising=False)


def _hidden_and_matrix(backend):
    assert not any(hasattr(dist, name) for name in NEWER)
    return run_matrix(backend, "cpu", modes=("standalone", "overlap", "ddp-small"))


def test_compressed_exchange_matches_its_reference() -> None:
    compressed.test_matches_reference_and_is_identical_on_every_rank(4)


def test_onebit_adam_matches_its_reference() -> None:
    onebit_adam.test_two_ranks_compression_stage_matches_reference()


def test_onebit_lamb_schedule_and_replicas() -> None:
    lamb_zero_one.test_lamb_four_ranks_one_fused_call_sigma_and_identical_replicas()


def test_zero_one_adam_schedule_and_replicas() -> None:
    lamb_zero_one.test_zero_one_four_ranks_schedule_collectives_variance_and_syncs()


def test_every_optimizer_and_mode_without_newer_collectives() -> None:
    check_matrix(run_ranks(_hidden_and_matrix, 4, timeout=280.0))
