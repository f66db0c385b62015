"""MpiBackend collectives on COMM_WORLD, checked against values every rank computes locally.

Each rank's input is a pure function of (rank, shape, dtype), so every rank can build every
other rank's input and the exact expected result without communicating. Collectives run first,
assertions after (see conftest.py).
"""

from __future__ import annotations

import math
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

import commopt
from commopt.comm import MpiBackend, resolve_backend, set_default_backend
from commopt.comm.mpi_backend import _stage_through_host

SHAPE = (3, 5)


def ints(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Small integers in [-8, 8] (as ``dtype``): sums of a few are exact in every float type."""
    k = torch.arange(math.prod(shape)).reshape(shape)
    v = (k * (2 * rank + 3) + 5 * rank) % 17 - 8
    if dtype == torch.bool:
        return v > 0
    if dtype == torch.uint8:
        return (v + 8).to(torch.uint8)  # 0 … 16: a sum over 4 ranks stays below 256
    return v.to(dtype)


def random_bits(rank: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int) -> torch.Tensor:
    """Arbitrary bit patterns of ``dtype`` (NaN payloads, ±inf, −0, subnormals included)."""
    g = torch.Generator().manual_seed(7919 * salt + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    )


# -- reductions ----------------------------------------------------------------------------------
REDUCED = [torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.bool]


# avg of integers and bools is refused; test_rejects_bad_arguments checks the message.
@pytest.mark.parametrize(
    ("op", "dtype"),
    [
        (op, dt)
        for dt in REDUCED
        for op in ("sum", "avg", "max", "min")
        if op != "avg" or dt.is_floating_point
    ],
)
def test_all_reduce(mpi_backend: MpiBackend, world, allgather, op: str, dtype: torch.dtype) -> None:
    rank, n = world
    t = ints(rank, SHAPE, dtype)
    ptr = t.data_ptr()
    out = mpi_backend.all_reduce(t, op)
    everyone = allgather(t)

    stack = torch.stack([ints(r, SHAPE, dtype) for r in range(n)])
    if dtype == torch.bool:  # torch.distributed's convention: sum/max = OR, min = AND
        expected = stack.all(0) if op == "min" else stack.any(0)
    elif op == "sum":
        expected = stack.sum(0).to(dtype)
    elif op == "avg":
        expected = stack.sum(0) / n
    elif op == "max":
        expected = stack.max(0).values
    else:
        expected = stack.min(0).values
    assert out is t and t.data_ptr() == ptr  # reduced in place
    assert t.dtype == dtype
    for r, got in enumerate(everyone):
        assert torch.equal(got, expected), f"rank {r}: {got} != {expected}"


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_all_reduce_half_runs_in_fp32_and_rounds_once(
    mpi_backend: MpiBackend, world, allgather, op: str, dtype: torch.dtype
) -> None:
    rank, n = world
    # Multiples of 2^-8 (fp16) / 2^-4 (bf16) that fill the mantissa: the inputs are exact, a sum
    # of n of them is exact in fp32 whatever the order, and rounding it back to the half type
    # loses bits. Expected = exact sum rounded once.
    frac, top = (256, 2047) if dtype == torch.float16 else (16, 255)

    def half(r: int) -> torch.Tensor:
        k = torch.arange(64)
        return ((k * (97 + 31 * r) + 13 * r) % (2 * top + 1) - top).to(torch.float64).div(frac)

    t = half(rank).to(dtype)
    mpi_backend.all_reduce(t, op)
    everyone = allgather(t)

    stack = torch.stack([half(r) for r in range(n)])
    assert torch.equal(stack.to(dtype).to(torch.float64), stack)  # inputs exact in dtype
    exact = {
        "sum": stack.sum(0),
        "avg": stack.sum(0) / n,
        "max": stack.max(0).values,
        "min": stack.min(0).values,
    }[op]
    expected = exact.to(dtype)
    if op == "sum":  # the test means something: some sums do not fit the half type
        assert not torch.equal(expected.to(torch.float64), exact)
    for r, got in enumerate(everyone):
        assert got.dtype == dtype and same_bits(got, expected), f"rank {r}"


# -- data movement -------------------------------------------------------------------------------
MOVED = [
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.uint8,
    torch.bool,
]


@pytest.mark.parametrize("dtype", MOVED)
def test_all_gather_bitwise(mpi_backend: MpiBackend, world, allgather, dtype: torch.dtype) -> None:
    rank, n = world
    t = random_bits(rank, SHAPE, dtype, salt=1)
    out = torch.empty((n, *SHAPE), dtype=dtype)
    flat = torch.empty(n * math.prod(SHAPE), dtype=dtype)  # any output shape of the right size
    mpi_backend.all_gather(out, t)
    mpi_backend.all_gather(flat, t)
    ok = allgather(
        all(same_bits(out[r], random_bits(r, SHAPE, dtype, salt=1)) for r in range(n))
        and same_bits(flat, out.reshape(-1))
    )
    assert all(ok), f"all_gather wrong on ranks {[r for r, v in enumerate(ok) if not v]}"


@pytest.mark.parametrize("dtype", MOVED)
def test_all_to_all_bitwise(mpi_backend: MpiBackend, world, allgather, dtype: torch.dtype) -> None:
    rank, n = world
    rows = 2  # rows j·2 … j·2+1 go to rank j
    t = random_bits(rank, (rows * n, 3), dtype, salt=2)
    out = torch.empty_like(t)
    mpi_backend.all_to_all(out, t)
    expected = torch.cat(
        [
            random_bits(i, (rows * n, 3), dtype, salt=2)[rank * rows : (rank + 1) * rows]
            for i in range(n)
        ]
    )
    ok = allgather(same_bits(out, expected))
    assert all(ok), f"all_to_all wrong on ranks {[r for r, v in enumerate(ok) if not v]}"


@pytest.mark.parametrize("dtype", MOVED)
def test_broadcast_from_non_zero_roots(mpi_backend: MpiBackend, world, allgather, dtype) -> None:
    rank, n = world
    results = {}
    for src in (n - 1, 1):
        t = random_bits(rank, SHAPE, dtype, salt=3 + src)
        ptr = t.data_ptr()
        mpi_backend.broadcast(t, src)
        results[src] = (
            same_bits(t, random_bits(src, SHAPE, dtype, salt=3 + src)) and t.data_ptr() == ptr
        )
    ok = allgather(results)
    assert all(all(v.values()) for v in ok), ok


def test_barrier_waits_for_everyone(mpi_backend: MpiBackend, world, allgather) -> None:
    rank, _n = world
    # Rank 0 writes a marker only after a pause, then enters the barrier. Whoever leaves the
    # barrier must find the marker: a barrier that did not wait would get there first.
    path = MPI.COMM_WORLD.bcast(tempfile.mkdtemp() if rank == 0 else None, root=0)
    marker = os.path.join(path, "rank0-was-here")
    mpi_backend.barrier()
    if rank == 0:
        time.sleep(0.5)
        with open(marker, "w") as f:
            f.write("x")
    mpi_backend.barrier()
    seen = allgather(os.path.exists(marker))
    mpi_backend.barrier()  # nobody removes the marker before everyone looked
    if rank == 0:
        os.remove(marker)
        os.rmdir(path)
    assert all(seen), f"ranks {[r for r, s in enumerate(seen) if not s]} left the barrier early"
    assert (
        mpi_backend.stats.calls_by_op["barrier"] == 3
        and mpi_backend.stats.bytes_by_op["barrier"] == 0
    )


# -- traffic counter -----------------------------------------------------------------------------
def test_byte_counter_per_operation(mpi_backend: MpiBackend, world) -> None:
    _rank, n = world
    be = mpi_backend
    be.all_reduce(torch.zeros(24), "sum")  # B = 96
    before = be.stats.snapshot()
    be.all_gather(torch.empty(n * 10, dtype=torch.float64), torch.zeros(10, dtype=torch.float64))
    be.all_to_all(torch.empty(4 * n, dtype=torch.int32), torch.zeros(4 * n, dtype=torch.int32))
    be.broadcast(torch.zeros(12, dtype=torch.bfloat16), 0)  # B = 24
    be.barrier()
    be.all_reduce(torch.zeros(8, dtype=torch.float16), "avg")  # B = 16 (counted as sent: fp16)

    # Textbook per-rank costs, written out here independently of commopt.comm.base.
    expected = {
        "all_reduce": 2 * (n - 1) * 96 // n + 2 * (n - 1) * 16 // n,
        "all_gather": (n - 1) * 80,
        "all_to_all": (n - 1) * (16 * n) // n,
        "broadcast": (n - 1) * 24 // n,
        "barrier": 0,
    }
    calls = {"all_reduce": 2, "all_gather": 1, "all_to_all": 1, "broadcast": 1, "barrier": 1}
    assert be.stats.bytes_by_op == expected
    assert be.stats.calls_by_op == calls
    assert be.stats.bytes_sent == sum(expected.values()) and be.stats.calls == 6
    region = be.stats - before
    assert region.calls == 5 and region.bytes_sent == sum(expected.values()) - 2 * (n - 1) * 96 // n


# -- buffers: no copies on CPU; where GPU tensors would go --------------------------------------
class RecordingComm:
    """COMM_WORLD, but remembers the address of every buffer handed to MPI."""

    def __init__(self) -> None:
        self.comm = MPI.COMM_WORLD
        self.seen: list[tuple[str, int | None, int | None]] = []

    def Get_rank(self) -> int:
        return self.comm.Get_rank()

    def Get_size(self) -> int:
        return self.comm.Get_size()

    @staticmethod
    def _addr(buf) -> int | None:
        # Get_address goes through the same buffer export (DLPack for torch tensors) as the
        # message arguments of the collectives do.
        return None if buf is MPI.IN_PLACE else MPI.Get_address(buf)

    def Allreduce(self, send, recv, op):
        self.seen.append(("Allreduce", self._addr(send), self._addr(recv)))
        return self.comm.Allreduce(send, recv, op=op)

    def Allgather(self, send, recv):
        self.seen.append(("Allgather", self._addr(send), self._addr(recv)))
        return self.comm.Allgather(send, recv)

    def Alltoall(self, send, recv):
        self.seen.append(("Alltoall", self._addr(send), self._addr(recv)))
        return self.comm.Alltoall(send, recv)

    def Bcast(self, buf, root):
        self.seen.append(("Bcast", self._addr(buf), None))
        return self.comm.Bcast(buf, root=root)


def test_cpu_tensors_reach_mpi_without_copies(world, allgather) -> None:
    rank, n = world
    rec = RecordingComm()
    be = MpiBackend(rec)
    big = torch.full((1 << 20,), float(rank + 1))
    bf = torch.zeros(6, dtype=torch.bfloat16)
    flags = torch.tensor([rank == 0, True, False])
    gathered = torch.empty(n * 3, dtype=torch.bool)
    a2a_in, a2a_out = torch.arange(2 * n, dtype=torch.int64), torch.empty(2 * n, dtype=torch.int64)
    be.all_reduce(big, "sum")
    be.broadcast(bf, n - 1)
    be.all_gather(gathered, flags)
    be.all_to_all(a2a_out, a2a_in)
    expected_seen = [
        ("Allreduce", None, big.data_ptr()),
        ("Bcast", bf.data_ptr(), None),
        ("Allgather", flags.data_ptr(), gathered.data_ptr()),
        ("Alltoall", a2a_in.data_ptr(), a2a_out.data_ptr()),
    ]
    results = allgather(
        (rec.seen == expected_seen, bool((big == n * (n + 1) / 2).all()), a2a_out.tolist())
    )
    for r, (addresses_ok, sum_ok, a2a) in enumerate(results):
        assert addresses_ok, f"rank {r}: MPI saw other buffers than the tensors: {rec.seen}"
        assert sum_ok, f"rank {r}: the in-place sum did not land in the tensor"
        assert a2a == [2 * r, 2 * r + 1] * n


def test_staging_decision() -> None:
    # No GPU is needed to check where a CUDA tensor would go: the decision is a pure function
    # of the device and the cuda_aware flag. (A GPU round trip belongs to tests/gpu.)
    cuda = torch.device("cuda", 0)
    assert _stage_through_host(torch.device("cpu"), cuda_aware=False) is False
    assert _stage_through_host(torch.device("cpu"), cuda_aware=True) is False
    assert _stage_through_host(cuda, cuda_aware=False) is True
    assert _stage_through_host(cuda, cuda_aware=True) is False
    with pytest.raises(ValueError, match=r"tensors on meta are not supported"):
        _stage_through_host(torch.device("meta"), cuda_aware=True)


def test_rejects_bad_arguments(mpi_backend: MpiBackend, world) -> None:
    _rank, n = world
    # Every check happens before any communication, on every rank alike.
    with pytest.raises(
        ValueError, match=r"op='avg' needs a floating-point tensor, got torch.int64"
    ):
        mpi_backend.all_reduce(torch.ones(3, dtype=torch.int64), "avg")
    with pytest.raises(ValueError, match=r"op='avg' needs a floating-point tensor, got torch.bool"):
        mpi_backend.all_reduce(torch.ones(3, dtype=torch.bool), "avg")
    with pytest.raises(ValueError, match=r"unknown op 'prod'"):
        mpi_backend.all_reduce(torch.ones(3), "prod")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"all_reduce: MPI needs contiguous tensors"):
        mpi_backend.all_reduce(torch.ones(4, 4).t())
    with pytest.raises(ValueError, match=rf"broadcast: src {n} out of range for world size {n}"):
        mpi_backend.broadcast(torch.ones(3), n)
    with pytest.raises(ValueError, match=rf"all_gather: expecting an output of {n} x 3 elements"):
        mpi_backend.all_gather(torch.empty(3 * n + 1), torch.ones(3))
    with pytest.raises(ValueError, match=r"tensors on meta are not supported"):
        mpi_backend.all_reduce(torch.ones(3, device="meta"))
    assert mpi_backend.stats.calls == 0  # nothing was counted for refused calls


# -- start-up and resolution under mpiexec -------------------------------------------------------
def test_backend_none_resolves_to_comm_world(world, monkeypatch: pytest.MonkeyPatch) -> None:
    rank, n = world
    set_default_backend(None)
    # SPEC §5 step 3 applies when torch.distributed is not running; the session may have
    # started it for other tests, so hide it for this check.
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    be = resolve_backend()
    assert isinstance(be, MpiBackend) and (be.rank, be.world_size) == (rank, n)
    assert resolve_backend() is be  # built once
    set_default_backend(None)


def test_init_mpi(world) -> None:
    rank, n = world
    try:
        be = commopt.init("mpi")
        assert isinstance(be, MpiBackend) and (be.rank, be.world_size) == (rank, n)
        assert resolve_backend() is be
    finally:
        set_default_backend(None)


@torch.no_grad()
def test_broadcast_parameters_over_mpi(mpi_backend: MpiBackend, world, allgather) -> None:
    rank, n = world
    torch.manual_seed(100 + rank)  # every rank starts different
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.BatchNorm1d(3))
    model[1].running_mean.add_(torch.randn(3))
    model[1].num_batches_tracked.fill_(rank)
    odd = torch.randn(4, 3).t()  # a non-contiguous tensor among plain ones
    extra = [odd, torch.randn(7, dtype=torch.float64)]
    src = n - 1
    before = allgather(
        ({k: v.clone() for k, v in model.state_dict().items()}, [t.clone() for t in extra])
    )
    commopt.broadcast_parameters(model, src=src, backend=mpi_backend)
    commopt.broadcast_parameters(extra, src=src, backend=mpi_backend)
    after = allgather((model.state_dict(), extra))
    want_model, want_extra = before[src]
    assert not torch.equal(before[0][0]["0.weight"], before[1][0]["0.weight"])  # did differ
    for r, (state, tensors) in enumerate(after):
        assert state.keys() == want_model.keys()
        for k, v in state.items():
            assert torch.equal(v, want_model[k]), f"rank {r}: {k}"
        assert all(torch.equal(a, b) for a, b in zip(tensors, want_extra, strict=True)), f"rank {r}"
    assert not odd.is_contiguous()  # updated through a contiguous copy, still the same view


def test_empty_tensors(mpi_backend: MpiBackend, world, allgather) -> None:
    _, n = world
    e = torch.empty(0)
    mpi_backend.all_reduce(e, "sum")
    mpi_backend.all_reduce(torch.empty(0, dtype=torch.float16), "avg")
    gathered = torch.empty(0, dtype=torch.bfloat16)
    mpi_backend.all_gather(gathered, torch.empty(0, dtype=torch.bfloat16))
    mpi_backend.all_to_all(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    mpi_backend.broadcast(torch.empty(0, 3), n - 1)
    done = allgather(mpi_backend.stats.calls)
    assert done == [5] * n and e.numel() == 0


def test_bootstrap_failure_on_rank0_reaches_every_rank(world, monkeypatch) -> None:
    import datetime

    from commopt import launch

    rank, _ = world
    if rank == 0:  # rank 0 cannot open its store (a bad MASTER_ADDR, a port in use, ...)

        def broken_store(*args, **kwargs):
            raise OSError("cannot bind")

        monkeypatch.setattr(dist, "TCPStore", broken_store)
    info = launch.discover_launch()
    timeout = datetime.timedelta(seconds=30)
    if rank == 0:
        with pytest.raises(OSError, match="cannot bind"):
            launch._mpi_bootstrap_store(info, timeout)
    else:  # the others fail too, with the reason, instead of waiting for an address forever
        with pytest.raises(RuntimeError, match=r"rank 0 could not open .*OSError: cannot bind"):
            launch._mpi_bootstrap_store(info, timeout)


def test_host_staging_path_round_trips(world, allgather, monkeypatch) -> None:
    # The copy-in / copy-back code that CUDA tensors take without a CUDA-aware MPI, run on CPU
    # tensors by forcing the staging decision: MPI must see other buffers than the tensors,
    # and the tensors must still end up with the right results.
    import commopt.comm.mpi_backend as mb

    rank, n = world
    monkeypatch.setattr(mb, "_stage_through_host", lambda device, cuda_aware: True)
    rec = RecordingComm()
    be = MpiBackend(rec)
    # Every tensor exists before the first call, so no staging buffer can reuse its address.
    red = ints(rank, SHAPE, torch.float16)
    out = torch.empty(n, *SHAPE, dtype=torch.bfloat16)
    src = random_bits(rank, SHAPE, torch.bfloat16, salt=9)
    a2a_in = torch.arange(2 * n, dtype=torch.int64) + 10 * rank
    a2a_out = torch.empty_like(a2a_in)
    b = random_bits(rank, SHAPE, torch.float32, salt=10)
    be.all_reduce(red, "sum")
    be.all_gather(out, src)
    be.all_to_all(a2a_out, a2a_in)
    be.broadcast(b, n - 1)
    tensors = [red, src, out, a2a_in, a2a_out, b]
    saw_own = any(
        addr in {t.data_ptr() for t in tensors} for _, *addrs in rec.seen for addr in addrs
    )
    ok = allgather(
        (
            torch.equal(red, sum(ints(r, SHAPE, torch.float64) for r in range(n)).half()),
            all(same_bits(out[r], random_bits(r, SHAPE, torch.bfloat16, salt=9)) for r in range(n)),
            a2a_out.tolist()
            == [v for r in range(n) for v in (10 * r + 2 * rank, 10 * r + 2 * rank + 1)],
            same_bits(b, random_bits(n - 1, SHAPE, torch.float32, salt=10)),
            saw_own,
        )
    )
    for r, (reduced, gathered, exchanged, broadcast, own) in enumerate(ok):
        assert reduced and gathered and exchanged and broadcast, (r, ok[r])
        assert not own, f"rank {r}: MPI was handed a tensor's own storage on the staged path"
