"""Launch discovery, init() at world size 1, and the backend=None resolution order (SPEC §5).

No test here starts MPI: the pytest process forks gloo ranks later, and Open MPI must not be
initialised in a process that forks. Where the MPI branch is exercised, ``MpiBackend`` is
replaced by a stand-in class that records that it was built.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import commopt
import commopt.comm as comm
import commopt.comm.default as comm_default
import commopt.launch as launch
from commopt.comm import SingleProcessBackend, TorchBackend, resolve_backend, set_default_backend
from commopt.launch import LaunchInfo, discover_launch, launched_by_mpi

LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALRANKID",
)

TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.1.2.3",
    "MASTER_PORT": "29511",
    "TORCHELASTIC_RUN_ID": "none",
}
OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "PMIX_RANK": "2",
}
MPICH = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "PMI_FD": "7"}


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch):
    """No launcher variables, no default backend, before and after the test."""
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    set_default_backend(None)
    yield monkeypatch
    set_default_backend(None)


# -- discover_launch ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (TORCHRUN, LaunchInfo("torchrun", 1, 4, 1, "10.1.2.3", 29511)),
        (OPEN_MPI, LaunchInfo("openmpi", 2, 4, 0, None, None)),
        (MPICH, LaunchInfo("mpich", 3, 4, 1, None, None)),
        ({}, LaunchInfo("none", 0, 1, 0, None, None)),
        # torchrun --nproc_per_node=1 style: a world of one needs no rendezvous address.
        ({"RANK": "0", "WORLD_SIZE": "1"}, LaunchInfo("torchrun", 0, 1, 0, None, None)),
        # mpirun with an explicit rendezvous address and no local-rank variable.
        (
            {"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_ADDR": "h0", "MASTER_PORT": "1234"},
            LaunchInfo("mpich", 0, 2, 0, "h0", 1234),
        ),
        # torchrun inside an MPI allocation: torchrun's variables describe this process.
        ({**OPEN_MPI, **TORCHRUN}, LaunchInfo("torchrun", 1, 4, 1, "10.1.2.3", 29511)),
    ],
    ids=["torchrun", "openmpi", "mpich", "none", "torchrun-1", "mpich-master", "torchrun-in-mpi"],
)
def test_discover_launch(env: dict[str, str], expected: LaunchInfo) -> None:
    assert discover_launch(env) == expected


def test_discover_launch_reads_os_environ(clean: pytest.MonkeyPatch) -> None:
    for key, value in OPEN_MPI.items():
        clean.setenv(key, value)
    assert discover_launch() == LaunchInfo("openmpi", 2, 4, 0, None, None)
    assert launched_by_mpi()


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"WORLD_SIZE": "4"}, r"WORLD_SIZE=4 is set but RANK is not"),
        ({"RANK": "0"}, r"RANK=0 is set but WORLD_SIZE is not"),
        (
            {"RANK": "one", "WORLD_SIZE": "4"},
            r"RANK environment variable must be an integer.*'one'",
        ),
        ({"RANK": "0", "WORLD_SIZE": "4.0"}, r"WORLD_SIZE .*integer.*'4.0'"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, r"RANK=4 is outside \[0, WORLD_SIZE=4\)"),
        ({"RANK": "-1", "WORLD_SIZE": "4"}, r"RANK=-1 is outside"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, r"WORLD_SIZE must be >= 1, got 0"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"},
            r"WORLD_SIZE=2 are set but MASTER_ADDR is not",
        ),
        ({"OMPI_COMM_WORLD_SIZE": "4"}, r"OMPI_COMM_WORLD_SIZE=4 is set but OMPI_COMM_WORLD_RANK"),
        ({"PMI_RANK": "5", "PMI_SIZE": "4"}, r"PMI_RANK=5 is outside \[0, PMI_SIZE=4\)"),
        ({**MPICH, "MPI_LOCALRANKID": "x"}, r"MPI_LOCALRANKID .*integer"),
        ({**TORCHRUN, "MASTER_PORT": "http"}, r"MASTER_PORT .*integer.*'http'"),
    ],
    ids=[
        "size-without-rank",
        "rank-without-size",
        "rank-not-int",
        "size-not-int",
        "rank-too-large",
        "rank-negative",
        "size-zero",
        "torchrun-no-master-addr",
        "ompi-size-without-rank",
        "pmi-rank-too-large",
        "local-rank-not-int",
        "port-not-int",
    ],
)
def test_discover_launch_rejects_inconsistent_environment(env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        discover_launch(env)


@pytest.mark.parametrize(
    ("env", "expected"),
    [(OPEN_MPI, True), (MPICH, True), (TORCHRUN, False), ({}, False)],
    ids=["openmpi", "mpich", "torchrun", "none"],
)
def test_launched_by_mpi(env: dict[str, str], expected: bool) -> None:
    assert launched_by_mpi(env) is expected


# -- init() --------------------------------------------------------------------------------------
def test_init_world_of_one_is_single_process(clean: pytest.MonkeyPatch) -> None:
    assert not dist.is_initialized()
    be = commopt.init()
    assert isinstance(be, SingleProcessBackend)
    assert resolve_backend() is be
    assert not dist.is_initialized()  # nothing to start for one process


def test_init_torchrun_world_of_one(clean: pytest.MonkeyPatch) -> None:
    clean.setenv("RANK", "0")
    clean.setenv("WORLD_SIZE", "1")
    assert isinstance(commopt.init("torch", device="cpu"), SingleProcessBackend)


def test_init_rejects_unknown_backend(clean: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"Invalid backend: 'bogus' \(expected 'auto', 'torch'"):
        commopt.init("bogus")  # type: ignore[arg-type]
    assert comm.get_default_backend() is None


def test_init_propagates_inconsistent_environment(clean: pytest.MonkeyPatch) -> None:
    clean.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE=2 is set but RANK is not"):
        commopt.init()
    assert comm.get_default_backend() is None


def test_init_needs_master_port_for_torch(clean: pytest.MonkeyPatch) -> None:
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}.items():
        clean.setenv(key, value)
    with pytest.raises(ValueError, match=r"MASTER_ADDR and MASTER_PORT must both be set.*None"):
        commopt.init(device="cpu")
    assert not dist.is_initialized()


class _FakeMpi:
    """Stands in for MpiBackend (COMM_WORLD of ``size`` processes) without starting MPI."""

    name = "mpi"
    size = 1
    built = 0

    def __init__(self, mpi_comm: object = None, *, cuda_aware: bool = False) -> None:
        type(self).built += 1
        self.rank, self.world_size, self.cuda_aware = 0, type(self).size, cuda_aware
        self.stats = comm.CommStats()


def test_init_mpi_refuses_a_world_mpi_does_not_see(clean: pytest.MonkeyPatch) -> None:
    # torchrun started 4 processes, but MPI (not launched by mpirun) sees a world of one.
    for key, value in TORCHRUN.items():
        clean.setenv(key, value)
    clean.setattr(launch, "MpiBackend", _FakeMpi)
    with pytest.raises(RuntimeError, match=r"COMM_WORLD has 1 process\(es\) but the torchrun"):
        commopt.init("mpi")
    assert comm.get_default_backend() is None


def test_init_mpi_sets_default(clean: pytest.MonkeyPatch) -> None:
    for key, value in OPEN_MPI.items():
        clean.setenv(key, value)
    fake = type("FakeMpi4", (_FakeMpi,), {"size": 4})
    clean.setattr(launch, "MpiBackend", fake)
    be = commopt.init("mpi", cuda_aware=True)
    assert isinstance(be, fake) and be.cuda_aware
    assert resolve_backend() is be


# -- resolve_backend order (SPEC §5) -----------------------------------------------------------
def test_resolve_backend_order(clean: pytest.MonkeyPatch, tmp_path) -> None:
    fake_mpi = type("FakeMpiCounted", (_FakeMpi,), {"size": 4, "built": 0})
    clean.setattr(comm_default, "MpiBackend", fake_mpi)

    # 4. nothing launched, nothing set: a world of one.
    assert isinstance(resolve_backend(), SingleProcessBackend)

    # 3. launched by an MPI launcher: COMM_WORLD, built once and re-used.
    for key, value in OPEN_MPI.items():
        clean.setenv(key, value)
    first = resolve_backend()
    assert isinstance(first, fake_mpi) and resolve_backend() is first and fake_mpi.built == 1

    # 2. torch.distributed initialized: its default group wins over MPI.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        tb = resolve_backend()
        assert isinstance(tb, TorchBackend) and tb.group is None
        assert resolve_backend() is tb  # cached wrapper keeps its counters

        # 1. an explicitly set default wins over everything; an argument wins over that.
        chosen = SingleProcessBackend()
        set_default_backend(chosen)
        assert resolve_backend() is chosen
        explicit = SingleProcessBackend()
        assert resolve_backend(explicit) is explicit
        set_default_backend(None)
        assert isinstance(resolve_backend(), TorchBackend)
    finally:
        dist.destroy_process_group()
    assert isinstance(resolve_backend(), fake_mpi)


# -- broadcast_parameters ----------------------------------------------------------------------
def test_broadcast_parameters_world_of_one_is_a_no_op(clean: pytest.MonkeyPatch) -> None:
    model = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        commopt.broadcast_parameters(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# -- the address rank 0 offers under mpirun ------------------------------------------------------
def _hosts(clean: pytest.MonkeyPatch, me: str, table: dict[str, str]) -> None:
    def resolve(name: str) -> str:
        if name not in table:
            raise OSError(f"unknown host {name}")
        return table[name]

    clean.setattr(launch.socket, "gethostname", lambda: me)
    clean.setattr(launch.socket, "gethostbyname", resolve)


def test_master_address_one_host_is_loopback(clean: pytest.MonkeyPatch) -> None:
    _hosts(clean, "node0", {})
    assert launch._master_address(["node0"] * 4) == "127.0.0.1"


def test_master_address_several_hosts(clean: pytest.MonkeyPatch) -> None:
    _hosts(clean, "node0", {"node0": "10.0.0.5", "node1": "10.0.0.6"})
    assert launch._master_address(["node0", "node0", "node1", "node1"]) == "10.0.0.5"


def test_master_address_avoids_loopback_name(clean: pytest.MonkeyPatch) -> None:
    # /etc/hosts maps the hostname to 127.0.1.1: use the interface routing to the peer instead
    # (here the peer is this machine's loopback, so the route is loopback too).
    _hosts(clean, "node0", {"node0": "127.0.1.1", "node1": "127.0.0.1"})
    assert launch._master_address(["node0", "node1"]) == "127.0.0.1"


def test_master_address_unresolvable_peer(clean: pytest.MonkeyPatch) -> None:
    _hosts(clean, "node0", {"node0": "127.0.1.1"})
    with pytest.raises(RuntimeError, match=r"cannot find an address of 'node0'.*set MASTER_ADDR"):
        launch._master_address(["node0", "node1"])


# -- bad input to init, and shutdown (issue #15.10, #15.7) -------------------------------------
@pytest.mark.parametrize("timeout", [0, -1, -0.5, float("nan"), float("inf")])
def test_init_refuses_a_timeout_that_is_not_positive(clean: pytest.MonkeyPatch, timeout) -> None:
    with pytest.raises(
        ValueError, match=r"Invalid timeout: .* \(must be a finite number of seconds > 0"
    ):
        commopt.init(timeout=timeout)
    assert comm.get_default_backend() is None  # nothing was started


@pytest.mark.parametrize("timeout", ["10", None, True])
def test_init_refuses_a_timeout_of_another_type(clean: pytest.MonkeyPatch, timeout) -> None:
    with pytest.raises(TypeError, match=r"Invalid timeout: .* \(must be a number of seconds\)"):
        commopt.init(timeout=timeout)


def test_shutdown_stops_the_watchdog_and_what_init_started(
    clean: pytest.MonkeyPatch, tmp_path
) -> None:
    import threading

    from commopt.faults import watch

    clean.setenv("RANK", "0")
    clean.setenv("WORLD_SIZE", "1")
    commopt.init()
    assert comm.get_default_backend() is not None
    # A watched backend with its thread running, as init() leaves it with more than one rank.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    be = watch(TorchBackend(), 30.0)
    be._ensure_thread()
    thread = be._wd_thread
    assert thread.is_alive() and thread.name == "commopt-watchdog"
    commopt.shutdown()
    assert not thread.is_alive()  # stopped and joined, not merely asked to stop
    assert not any(t.name == "commopt-watchdog" for t in threading.enumerate())
    assert comm.get_default_backend() is None
    assert dist.is_initialized()  # a group the user created is the user's to destroy
    t = torch.ones(2)
    be.all_reduce(t)  # the backend stays usable, unguarded: no new thread
    assert be._wd_thread is thread and not thread.is_alive()
    dist.destroy_process_group()
    commopt.shutdown()  # twice, and without init: harmless
