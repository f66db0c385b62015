"""The GPU-only Python paths, run without a GPU: fakes stand in for the device, streams and CuPy.

What is faked, and nothing more: a CUDA tensor (:class:`OnDevice`, a CPU tensor that reports
``cuda:<i>``), ``torch.cuda.current_stream`` (streams that log ``synchronize()``), allocations
with ``device="cuda"``, and for CupyRuntime a ``cupy`` module whose ``RawModule`` compiles with
tests/cuda_on_cpu. The code under test is the real one: MpiBackend's host staging and its
stream synchronisation before MPI reads device memory (``cuda_aware=True``), MixedBackend's
drain when it switches away from a child that touched CUDA tensors, and CupyKernels on its
default runtime (torch's current stream handed to every launch, the device context entered only
when torch's current device is another, the per-device module cache, raw device pointers).

Optimizer state on a CUDA device needs real CUDA tensors (torch's CPU build cannot allocate
them, and a fake deep enough to run a whole optimizer would be testing itself):
tests/gpu/test_cuda_kernels.py covers it where a GPU exists (see tests/gpu/README.md).
"""

from __future__ import annotations

import shutil
import sys
import types
from typing import Any

import numpy as np
import pytest
import torch

import commopt.comm.mpi_backend as mpi_backend
import commopt.kernels.cupy_kernels as cupy_kernels
import commopt.kernels.cupy_runtime as cupy_runtime
from commopt.comm import CommStats, MixedBackend
from commopt.comm.mpi_backend import MpiBackend

_REAL_EMPTY = torch.empty


class OnDevice:
    """Stands in for a CUDA tensor: a CPU tensor (``inner``) that reports ``cuda:<index>``.

    Moving it to the host and copying into it are logged as ``d2h`` and ``h2d``.
    """

    is_cuda = True

    def __init__(self, inner: torch.Tensor, log: list[str], index: int = 0) -> None:
        self.inner, self.log = inner, log
        self.device = torch.device("cuda", index)

    def __getattr__(self, name: str) -> Any:  # shape, dtype, numel, element_size, ...
        return getattr(self.inner, name)

    def _same(self, inner: torch.Tensor) -> OnDevice:
        return OnDevice(inner, self.log, self.device.index)

    def to(self, *args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device", args[0] if args else None)
        if device is not None and torch.device(device).type == "cpu":
            self.log.append("d2h")
            return self.inner.clone()
        return self._same(self.inner.to(dtype=kwargs.get("dtype", self.inner.dtype)))

    def copy_(self, src: Any) -> OnDevice:
        self.log.append("h2d")
        self.inner.copy_(src.inner if isinstance(src, OnDevice) else src)
        return self

    def view(self, *args: Any) -> OnDevice:
        return self._same(self.inner.view(*args))

    def reshape(self, *args: Any) -> OnDevice:
        return self._same(self.inner.reshape(*args))

    def detach(self) -> OnDevice:
        return self

    def contiguous(self) -> OnDevice:
        return self._same(self.inner.contiguous())

    def __getitem__(self, key: Any) -> OnDevice:
        return self._same(self.inner[key])


class FakeStream:
    def __init__(self, device: torch.device, log: list[str]) -> None:
        self.device, self.log = torch.device(device), log
        self.cuda_stream = 0x5000 + (self.device.index or 0)  # a raw cudaStream_t handle

    def synchronize(self) -> None:
        self.log.append(f"sync {self.device}")


@pytest.fixture
def log(monkeypatch) -> list[str]:
    """One shared event log; torch.cuda's stream calls and CUDA allocations are faked."""
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: FakeStream(dev, events))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def empty(*size: Any, device: Any = None, **kwargs: Any) -> Any:
        if device is not None and torch.device(device).type == "cuda":
            return OnDevice(_REAL_EMPTY(*size, **kwargs), events, torch.device(device).index)
        return _REAL_EMPTY(*size, device=device, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    return events


# -- MpiBackend: staging through host memory, or device pointers after a stream sync --------------
class FakeComm:
    """Two ranks seen from rank 0: the other rank always contributes ``other``."""

    def __init__(self, log: list[str], other: float = 10.0) -> None:
        self.log, self.other = log, other

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 2

    def _data(self, buf: Any, name: str) -> torch.Tensor:
        self.log.append(f"MPI {name} {buf.device}")
        return buf.inner if isinstance(buf, OnDevice) else buf

    def Allreduce(self, in_place: Any, buf: Any, op: Any) -> None:
        self._data(buf, "Allreduce").add_(self.other)

    def Allgather(self, send: Any, recv: Any) -> None:
        s, r = self._data(send, "Allgather"), recv.inner if isinstance(recv, OnDevice) else recv
        r[: s.numel()] = s
        r[s.numel() :] = self.other

    def Alltoall(self, send: Any, recv: Any) -> None:
        s, r = self._data(send, "Alltoall"), recv.inner if isinstance(recv, OnDevice) else recv
        half = s.numel() // 2
        r[:half] = s[:half]
        r[half:] = self.other

    def Bcast(self, buf: Any, root: int) -> None:
        self._data(buf, "Bcast")


@pytest.fixture
def fake_mpi(monkeypatch):
    mpi = types.SimpleNamespace(
        IN_PLACE=object(),
        SUM="sum",
        MAX="max",
        MIN="min",
        # one thread inside MPI only: the non-blocking collectives fall back to blocking calls
        THREAD_SINGLE=0,
        THREAD_MULTIPLE=3,
        Query_thread=lambda: 0,
    )
    monkeypatch.setattr(mpi_backend, "_import_mpi", lambda: mpi)
    return mpi


@pytest.mark.parametrize("cuda_aware", [False, True])
def test_mpi_backend_on_cuda_tensors(log, fake_mpi, cuda_aware):
    backend = MpiBackend(FakeComm(log), cuda_aware=cuda_aware)
    t = OnDevice(torch.arange(4, dtype=torch.float32), log)
    backend.all_reduce(t)
    assert torch.equal(t.inner, torch.arange(4, dtype=torch.float32) + 10)
    out = OnDevice(torch.zeros(8), log)
    backend.all_gather(out, t)
    assert torch.equal(out.inner, torch.cat([t.inner, torch.full((4,), 10.0)]))
    out = OnDevice(torch.zeros(4), log)
    backend.all_to_all(out, t)
    assert torch.equal(out.inner, torch.tensor([10.0, 11.0, 10.0, 10.0]))
    if cuda_aware:
        # Device pointers straight to MPI, each call after a sync of torch's current stream.
        assert log == [
            "sync cuda:0",
            "MPI Allreduce cuda:0",
            "sync cuda:0",
            "sync cuda:0",
            "MPI Allgather cuda:0",
            "sync cuda:0",
            "sync cuda:0",
            "MPI Alltoall cuda:0",
        ]
    else:
        # Staged: a blocking device-to-host copy (which waits for the stream) before MPI, the
        # result copied back after; MPI only ever sees host memory, and no explicit sync.
        assert log == [
            "d2h",
            "MPI Allreduce cpu",
            "h2d",
            "d2h",
            "MPI Allgather cpu",
            "h2d",
            "d2h",
            "MPI Alltoall cpu",
            "h2d",
        ]


def test_mpi_backend_refuses_other_devices(fake_mpi):
    with pytest.raises(ValueError, match=r"tensors on meta are not supported"):
        MpiBackend(FakeComm([])).all_reduce(torch.empty(4, device="meta"))


# -- MixedBackend: the drain before switching away from a child that touched CUDA tensors ---------
class Child:
    """A world-of-one child that logs its calls (and, when asked, has a synchronize())."""

    def __init__(self, name: str, log: list[str], asynchronous: bool = False) -> None:
        self.name, self.log, self.rank, self.world_size = name, log, 0, 1
        self.stats = CommStats()
        if asynchronous:
            self.synchronize = lambda: log.append(f"{name}.synchronize")

    def all_reduce(self, t: Any, op: str = "sum") -> Any:
        self.log.append(f"{self.name} all_reduce {t.device}")
        return t

    def all_gather(self, out: Any, t: Any) -> Any:
        raise AssertionError("not routed here in this test")

    all_to_all = all_gather

    def broadcast(self, t: Any, src: int = 0) -> Any:
        raise AssertionError("not routed here in this test")

    def barrier(self) -> None:
        raise AssertionError("not routed here in this test")


def _table() -> dict:
    rule = {"op": "all_reduce", "dtype": "*", "min_bytes": 0, "max_bytes": 1024, "backend": "a"}
    big = dict(rule, min_bytes=1024, max_bytes=None, backend="b")
    return {"format": "commopt-selection-table", "version": 1, "default": "a", "rules": [rule, big]}


def test_mixed_backend_drains_cuda_work_when_switching(log):
    mixed = MixedBackend({"a": Child("a", log), "b": Child("b", log, asynchronous=True)}, _table())
    small_dev, big_dev = OnDevice(torch.zeros(4), log), OnDevice(torch.zeros(1024), log)
    small_cpu, big_cpu = torch.zeros(4), torch.zeros(1024)
    mixed.all_reduce(small_dev)  # a
    mixed.all_reduce(small_dev)  # a again: no switch, no drain
    mixed.all_reduce(big_dev)  # a -> b: a touched cuda:0, so the stream is synchronized first
    mixed.all_reduce(small_cpu)  # b -> a: b is asynchronous (synchronize) and touched cuda:0
    mixed.all_reduce(big_cpu)  # a -> b: a's last call was on host memory: nothing to wait for
    assert log == [
        "a all_reduce cuda:0",
        "a all_reduce cuda:0",
        "sync cuda:0",
        "b all_reduce cuda:0",
        "b.synchronize",
        "sync cuda:0",
        "a all_reduce cpu",
        "b all_reduce cpu",
    ]
    assert mixed.switches == 3


# -- CupyKernels on its real runtime, with a fake cupy whose RawModule runs on the CPU ------------
@pytest.fixture
def fake_cupy(monkeypatch, log):
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed (scripts/test.sh installs it)")
    from tests.cuda_on_cpu import compile_source

    state: dict[str, Any] = {"device": None, "current": 0, "compiled": []}

    class Device:
        def __init__(self, index: int) -> None:
            self.index = index

        def __enter__(self) -> Device:
            self.saved, state["device"] = state["device"], self.index
            return self

        def __exit__(self, *exc: object) -> None:
            state["device"] = self.saved

    class ExternalStream:
        def __init__(self, handle: int, device_id: int) -> None:
            self.ptr, self.device_id = handle, device_id

    class RawModule:
        def __init__(self, code: str) -> None:
            self.code, self.device = code, state["device"]
            state["compiled"].append(self.device)

        def compile(self) -> None:
            self.module = compile_source(self.code, fibers=True)

        def get_function(self, name: str):
            function = self.module.get_function(name)

            def launch(grid: tuple, block: tuple, args: tuple, shared_mem: int, stream) -> None:
                # CuPy's Function: raw pointers as np.uint64, the stream as an object with .ptr
                assert all(isinstance(a, np.generic) for a in args), args
                device = state["device"] if state["device"] is not None else state["current"]
                log.append(f"{name} device={device} stream={stream.ptr:#x}")
                function(grid, block, args)

            return types.SimpleNamespace(kernel=launch)

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(Device=Device, ExternalStream=ExternalStream)
    cupy.RawModule = RawModule
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream", raising=False)  # the faked stream
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    cupy_runtime._module.cache_clear()
    yield state
    cupy_runtime._module.cache_clear()


class OnFakeGpu:
    """Kernels over CPU tensors that hand ``inner`` OnDevice views to the CUDA kernel set."""

    name = "cupy on a fake GPU"

    def __init__(self, kernels: Any, log: list[str]) -> None:
        self.kernels, self.log = kernels, log

    def __getattr__(self, method: str) -> Any:
        def call(*args: Any) -> Any:
            moved = [OnDevice(a, self.log) if isinstance(a, torch.Tensor) else a for a in args]
            result = getattr(self.kernels, method)(*moved)
            return result.inner if isinstance(result, OnDevice) else result

        return call


def test_cupy_runtime_launches_on_torchs_stream_and_matches_the_reference(fake_cupy, log):
    from tests.cuda_on_cpu.checks import check_against_reference

    kernels = cupy_kernels.CupyKernels()  # the default runtime: CupyRuntime, on the fake cupy
    assert isinstance(kernels.runtime, cupy_runtime.CupyRuntime)
    check_against_reference(OnFakeGpu(kernels, log), 5000, 3, seed=7, spread=6)
    launches = [entry for entry in log if entry.startswith("commopt_")]
    # compensate, pack_worker_, scale, pack_compensated_, server 2, unpack; then the odd-offset
    # views: scale, pack_compensated_, unpack. One launch per norm: no finishing kernel.
    assert len(launches) == 10, launches
    # Every launch on the tensor's device and on torch's current stream of that device.
    assert all(entry.endswith("device=0 stream=0x5000") for entry in launches), launches
    # One compile per source per device, each inside that device's context.
    assert fake_cupy["compiled"] == [0, 0, 0]


def test_cupy_runtime_enters_the_tensors_device_when_another_is_current(fake_cupy, log):
    """torch's current device is 1, the tensors are on cuda:0: the launch goes to device 0 and
    the stream current there (the launcher is per device and stream)."""
    from tests.cuda_on_cpu.checks import check_against_reference

    fake_cupy["current"] = 1
    kernels = cupy_kernels.CupyKernels()
    check_against_reference(OnFakeGpu(kernels, log), 3000, 2, seed=3, spread=3)
    launches = [entry for entry in log if entry.startswith("commopt_")]
    assert launches and all(entry.endswith("device=0 stream=0x5000") for entry in launches)


def test_cupy_runtime_runs_the_staged_server_step_on_torchs_stream(fake_cupy, log):
    """server_stages through CupyRuntime: every launch (average per range, t, pack per range)
    on the chunk's device and torch's current stream, and the result server_reduce_'s bits."""
    from tests.cuda_on_cpu.checks import SERVER_BLOCK, values

    kernels = cupy_kernels.CupyKernels()
    rng = np.random.default_rng(3)
    n, chunk = 3, 2 * SERVER_BLOCK + 40
    recv = torch.from_numpy(rng.integers(0, 256, (n, chunk // 8), dtype=np.uint8))
    scales = torch.from_numpy(np.abs(values(rng, n, 2)))
    f0 = torch.from_numpy(values(rng, chunk, 3) * np.float32(0.01))
    f_whole, bits_whole = f0.clone(), torch.empty(chunk // 8, dtype=torch.uint8)
    t_whole = kernels.server_reduce_(
        OnDevice(recv, log),
        OnDevice(scales, log),
        OnDevice(f_whole, log),
        OnDevice(bits_whole, log),
    ).inner
    del log[:]
    f_staged, bits_staged = f0.clone(), torch.empty(chunk // 8, dtype=torch.uint8)
    stages = kernels.server_stages(OnDevice(f_staged, log))
    ranges = [(SERVER_BLOCK, chunk), (0, SERVER_BLOCK)]
    for lo, hi in ranges:
        rows = OnDevice(recv[:, lo // 8 : hi // 8].contiguous(), log)
        stages.average_(rows, OnDevice(scales, log), lo)
    t_staged = stages.scale()
    for lo, hi in ranges:
        stages.pack_(t_staged, lo, OnDevice(bits_staged[lo // 8 : hi // 8], log))
    launches = [entry for entry in log if entry.startswith("commopt_")]
    assert [entry.split()[0] for entry in launches] == [
        "commopt_server_average",
        "commopt_server_average",
        "commopt_finish_rms",
        "commopt_pack_update",
        "commopt_pack_update",
    ]
    assert all(entry.endswith("device=0 stream=0x5000") for entry in launches), launches
    assert torch.equal(t_staged.inner.view(torch.int32), t_whole.view(torch.int32))
    assert torch.equal(f_staged.view(torch.int32), f_whole.view(torch.int32))
    assert torch.equal(bits_staged, bits_whole)
