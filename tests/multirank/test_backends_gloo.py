"""TorchBackend on forked gloo ranks: collectives, a sub-group, broadcast_parameters, init().

Inputs are pure functions of the rank, so the parent process computes every expected result
itself; ranks only return what they received.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import pickle

import pytest
import torch
import torch.distributed as dist

import commopt
from commopt import compressed_allreduce, padded_size
from commopt.comm import TorchBackend
from commopt.comm.torch_backend import staging_device_type
from commopt.kernels import TorchKernels, use_kernels
from tests.multirank.harness import free_port, run_ranks

N = 4
SHAPE = (3, 5)


def ints(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Small integers in [-8, 8]: sums of a few are exact, whatever order gloo adds in."""
    k = torch.arange(math.prod(shape)).reshape(shape)
    return ((k * (2 * rank + 3) + 5 * rank) % 17 - 8).to(dtype)


# -- the collectives on the default group --------------------------------------------------------
def collective_results(be: TorchBackend) -> dict:
    """Every collective of the backend on small CPU tensors (checked by
    :func:`check_collective_results`)."""
    r, n = be.rank, be.world_size
    got: dict = {}
    for dtype in (torch.float32, torch.int64):
        for op in ("sum", "avg", "max", "min"):
            if op == "avg" and not dtype.is_floating_point:
                continue
            t = ints(r, SHAPE, dtype)
            ptr = t.data_ptr()
            be.all_reduce(t, op)
            got[("all_reduce", op, dtype)] = (t, t.data_ptr() == ptr)
    gathered = torch.empty(n, *SHAPE)
    be.all_gather(gathered, ints(r, SHAPE, torch.float32))
    got["all_gather"] = gathered
    exchanged = torch.empty(2 * n, 3, dtype=torch.int64)
    be.all_to_all(exchanged, ints(r, (2 * n, 3), torch.int64))
    got["all_to_all"] = exchanged
    for src in (n - 1, 1):
        t = ints(r, SHAPE, torch.float64)
        be.broadcast(t, src)
        got[("broadcast", src)] = t
    be.barrier()
    got["stats"] = be.stats.snapshot()
    return got


def test_collectives_on_four_ranks() -> None:
    check_collective_results(run_ranks(collective_results, N, timeout=120))


def check_collective_results(results: list[dict]) -> None:
    """Each rank's :func:`collective_results` against the sums, gathers and copies computed
    here."""
    assert len(results) == N
    for rank, got in enumerate(results):
        for dtype in (torch.float32, torch.int64):
            stack = torch.stack([ints(r, SHAPE, dtype) for r in range(N)])
            expected = {
                "sum": stack.sum(0),
                "avg": stack.sum(0) / N,
                "max": stack.max(0).values,
                "min": stack.min(0).values,
            }
            for op, want in expected.items():
                if op == "avg" and not dtype.is_floating_point:
                    continue
                t, in_place = got[("all_reduce", op, dtype)]
                assert in_place and t.dtype == dtype, (rank, op, dtype)
                assert torch.equal(t, want.to(dtype)), f"rank {rank}: {op} {dtype}"
        assert torch.equal(
            got["all_gather"], torch.stack([ints(r, SHAPE, torch.float32) for r in range(N)])
        )
        want_a2a = torch.cat(
            [ints(i, (2 * N, 3), torch.int64)[2 * rank : 2 * rank + 2] for i in range(N)]
        )
        assert torch.equal(got["all_to_all"], want_a2a), f"rank {rank}"
        for src in (N - 1, 1):
            assert torch.equal(got[("broadcast", src)], ints(src, SHAPE, torch.float64))
        stats = got["stats"]
        # 7 all-reduces of 15 elements (4 fp32 + 3 int64 ops), textbook per-rank costs.
        assert stats.calls_by_op == {
            "all_reduce": 7,
            "all_gather": 1,
            "all_to_all": 1,
            "broadcast": 2,
            "barrier": 1,
        }
        assert stats.bytes_by_op["all_reduce"] == 2 * (N - 1) * (4 * 60 + 3 * 120) // N
        assert stats.bytes_by_op["all_gather"] == (N - 1) * 60
        assert stats.bytes_by_op["all_to_all"] == (N - 1) * (2 * N * 3 * 8) // N
        assert stats.bytes_by_op["broadcast"] == 2 * ((N - 1) * 120 // N)


# -- any process group: a sub-group of ranks 1, 2, 3 ---------------------------------------------
SUB = [1, 2, 3]
LENGTH = 203  # not a multiple of 8·3


def _compressed_inputs(group_rank: int, call: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 * call + group_rank)
    return torch.randn(LENGTH, generator=g) * (group_rank + 1)


def _three_compressed_calls(be: TorchBackend) -> list[torch.Tensor]:
    e = torch.zeros(padded_size(LENGTH, be.world_size))
    f = torch.zeros(padded_size(LENGTH, be.world_size) // be.world_size)
    # What is tested here is the group, not the per-element kernels: the reference kernels
    # spare each forked rank a JIT start-up of its own.
    with use_kernels(TorchKernels()):
        return [compressed_allreduce(_compressed_inputs(be.rank, c), e, f, be) for c in range(3)]


def _on_subgroup(world_be: TorchBackend) -> dict | None:
    group = dist.new_group(SUB)  # collective over the whole world, members or not
    if world_be.rank not in SUB:
        world_be.barrier()
        return None
    be = TorchBackend(group)
    r, n = be.rank, be.world_size
    t = ints(r, SHAPE, torch.float32)
    be.all_reduce(t, "sum")
    gathered = torch.empty(n, *SHAPE)
    be.all_gather(gathered, ints(r, SHAPE, torch.float32))
    exchanged = torch.empty(2 * n, 3, dtype=torch.int64)
    be.all_to_all(exchanged, ints(r, (2 * n, 3), torch.int64))
    b = ints(r, SHAPE, torch.float64)
    be.broadcast(b, n - 1)  # group rank 2 = global rank 3
    compressed = _three_compressed_calls(be)
    world_be.barrier()
    return {
        "rank": r,
        "world_size": n,
        "sum": t,
        "all_gather": gathered,
        "all_to_all": exchanged,
        "broadcast": b,
        "compressed": compressed,
    }


def test_subgroup_is_a_world_of_its_own() -> None:
    results = run_ranks(_on_subgroup, N, timeout=120)
    # The same compressed calls on a separate world of 3 ranks: the sub-group must match it.
    reference = run_ranks(_three_compressed_calls, len(SUB), timeout=120)
    assert results[0] is None
    n = len(SUB)
    for global_rank, got in zip(SUB, results[1:], strict=True):
        r = SUB.index(global_rank)
        assert (got["rank"], got["world_size"]) == (r, n)
        assert torch.equal(got["sum"], sum(ints(i, SHAPE, torch.float32) for i in range(n)))
        assert torch.equal(
            got["all_gather"], torch.stack([ints(i, SHAPE, torch.float32) for i in range(n)])
        )
        want = torch.cat([ints(i, (2 * n, 3), torch.int64)[2 * r : 2 * r + 2] for i in range(n)])
        assert torch.equal(got["all_to_all"], want)
        assert torch.equal(got["broadcast"], ints(n - 1, SHAPE, torch.float64))
        for call, (a, b) in enumerate(zip(got["compressed"], reference[r], strict=True)):
            assert torch.equal(a, b), f"group rank {r}, call {call}: sub-group != 3-rank world"


# -- broadcast_parameters ------------------------------------------------------------------------
@torch.no_grad()
def _outside_group(be: TorchBackend) -> str:
    group = dist.new_group([0, 1])  # every rank must take part in creating it
    try:
        TorchBackend(group)
    except ValueError as err:
        return str(err)
    return "created"


def test_backend_on_a_rank_outside_its_group_is_refused() -> None:
    results = run_ranks(_outside_group, 3)
    assert results[:2] == ["created", "created"]
    assert "global rank 2 is not a member of the given process group" in results[2]


def _broadcast_parameters(be: TorchBackend, src: int) -> tuple[dict, dict]:
    torch.manual_seed(10 + be.rank)  # replicas start different
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)
    )
    model[1].running_var.mul_(1 + be.rank)
    model[1].num_batches_tracked.fill_(7 * be.rank)
    model[2].weight.data = model[2].weight.data.t().contiguous().t()  # non-contiguous parameter
    before = {k: v.clone() for k, v in model.state_dict().items()}
    commopt.broadcast_parameters(model, src=src)  # backend=None: the harness's default
    return before, {k: v.clone() for k, v in model.state_dict().items()}


def test_broadcast_parameters_makes_replicas_equal() -> None:
    for src in (0, 2):
        results = run_ranks(_broadcast_parameters, N, src, timeout=120)
        want = results[src][0]
        assert not torch.equal(results[0][0]["0.weight"], results[1][0]["0.weight"])
        for rank, (_, after) in enumerate(results):
            assert after.keys() == want.keys()
            for k in want:
                assert torch.equal(after[k], want[k]), f"src {src}, rank {rank}: {k}"


# -- init() from torchrun's variables (the launch path without torchrun itself) -----------------


def _torchrun_rank(rank: int, n: int, port: int, queue) -> None:
    try:
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(n),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        for var in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE"):
            os.environ.pop(var, None)
        be = commopt.init(device="cpu", timeout=60)
        t = torch.tensor([float(rank + 1)])
        be.all_reduce(t, "sum")
        queue.put(
            (
                rank,
                pickle.dumps(
                    (isinstance(be, TorchBackend), be.engine, be.rank, be.world_size, t.item())
                ),
            )
        )
    except BaseException as err:
        queue.put((rank, pickle.dumps(f"{type(err).__name__}: {err}")))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_init_from_torchrun_variables() -> None:
    n, ctx = 2, mp.get_context("fork")
    queue, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=_torchrun_rank, args=(r, n, port, queue), daemon=True) for r in range(n)
    ]
    for p in procs:
        p.start()
    try:
        got = dict(queue.get(timeout=120) for _ in range(n))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    for rank in range(n):
        assert pickle.loads(got[rank]) == (True, "gloo", rank, n, 3.0)


# -- a group without a CPU backend (NCCL alone) ---------------------------------------------------
@pytest.mark.parametrize(
    "config, via",
    [
        ("cpu:gloo,cuda:gloo", None),  # "gloo"
        ("cpu:gloo,cuda:nccl", None),
        ("cuda:nccl", "cuda"),  # "nccl", and torch's default on a CUDA machine
        ("cpu:mpi,cuda:mpi", None),
        ("xpu:xccl", "xpu"),
    ],
)
def test_cpu_tensors_are_staged_exactly_where_the_group_has_no_cpu_backend(config, via) -> None:
    assert staging_device_type(config) == via


def _cpu_less(be: TorchBackend) -> tuple[str | None, str, str]:
    try:
        dist.all_reduce(torch.zeros(2))
        refused = ""
    except RuntimeError as err:
        refused = str(err)
    try:
        be.all_reduce(torch.zeros(2))
        staged = ""
    except RuntimeError as err:  # no CUDA on this machine to stage through
        staged = str(err)
    return be.cpu_staging, refused, staged


def test_a_group_without_a_cpu_backend_refuses_cpu_tensors_so_the_backend_stages_them() -> None:
    """On NCCL alone torch refuses a CPU tensor, and every agreement check of commopt's is one.
    "cuda:gloo" has the same shape and runs here: torch refuses, and TorchBackend would hand
    the tensor to the GPU instead; this machine has none, which it says (tests/gpu runs the
    staging on one)."""
    ((staging, refused, staged),) = run_ranks(_cpu_less, 1, timeout=60, engine="cuda:gloo")
    assert staging == "cuda"
    assert "No backend type associated with device type cpu" in refused
    assert "no CPU backend (cuda:gloo) and no cuda device is available" in staged
    gloo = run_ranks(_cpu_less, 2, timeout=60)
    assert all(r == (None, "", "") for r in gloo)
