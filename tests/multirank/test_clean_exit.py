"""A script that follows the README's "Use" snippet exits 0, every time (issue #15.7).

The defect: with torch 2.13 about half of such runs died at exit with SIGABRT ("terminate called
without an active exception") while commopt's watchdog thread was still running. Each run here
is two real rank processes that end the way any script ends: the interpreter finalizes
(``atexit`` hooks, thread shutdown, module teardown) and the C runtime exits. To keep it cheap,
one launcher imports torch and commopt once and forks the two ranks of each run of every script
below, which then run the script with torchrun's environment variables and exit normally (a
``SystemExit`` raised to the top of the launcher, not ``os._exit``), so the same teardown runs as
under torchrun.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

# A defect that killed about half of the runs escapes 10 runs once in a thousand; each run costs
# ~2.2 s, most of it the interpreter tearing torch down, as in any script that imports it.
RUNS = 10

# The README "Use" snippet, with a tiny model and loader.
README_SCRIPT = textwrap.dedent(
    """
    import torch, commopt

    def build_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    loader = [torch.randn(4, 8) for _ in range(6)]

    commopt.init()
    model = build_model()
    commopt.broadcast_parameters(model)
    opt = commopt.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=3)
    for batch in loader:
        loss = model(batch).mean(); loss.backward()
        opt.step(); opt.zero_grad()
    commopt.shutdown()
    """
)

LAUNCHER = textwrap.dedent(
    """
    import json, os, runpy, socket, sys
    import time
    import torch, commopt  # imported once; every forked rank inherits them
    from commopt.kernels.numba_kernels import NumbaKernels

    # Warm up here, once: the numba kernels, and one optimizer step at world size 1, whose lazy
    # imports (torch.optim's) otherwise cost each rank seconds on a loaded machine.
    NumbaKernels().warm_up()
    w = torch.nn.Parameter(torch.zeros(4))
    w.grad = torch.ones(4)
    commopt.OnebitAdam([w], freeze_step=1, backend=commopt.SingleProcessBackend()).step()

    # [[name, script path, runs], ...]; each script's rank output goes to <name>.log
    for name, script, runs in json.loads(sys.argv[1]):
        failures = 0
        for run in range(runs):
            t0 = time.monotonic()
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            pids = []
            for rank in range(2):
                pid = os.fork()
                if pid == 0:
                    log = os.open(f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
                    os.dup2(log, 1)
                    os.dup2(log, 2)
                    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                    sys.argv = [script]
                    runpy.run_path(script, run_name="__main__")
                    raise SystemExit(0)  # ends this rank like the end of a script: full teardown
                pids.append(pid)
            codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
            failures += any(codes)
            print(f"{name} run {run}: exit codes {codes} ({time.monotonic() - t0:.1f} s)",
                  flush=True)
        print(f"{name}: {failures} of {runs} runs failed", flush=True)
    """
)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[pathlib.Path, str]:
    """Run every script of :data:`SCRIPTS` in one launcher; (the folder with each
    ``<name>.log``, the launcher's stdout)."""
    tmp = tmp_path_factory.mktemp("clean_exit")
    plan = []
    for name, (script, runs) in SCRIPTS.items():
        (tmp / f"{name}.py").write_text(script)
        plan.append([name, str(tmp / f"{name}.py"), runs])
    (tmp / "launch.py").write_text(LAUNCHER)
    proc = subprocess.run(
        ["timeout", "840", sys.executable, str(tmp / "launch.py"), json.dumps(plan)],
        capture_output=True,
        text=True,
        cwd=str(tmp),
        timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return tmp, proc.stdout


def _assert_every_run_exits_zero(launched: tuple[pathlib.Path, str], name: str) -> None:
    tmp, stdout = launched
    runs = SCRIPTS[name][1]
    log = (tmp / f"{name}.log").read_text() if (tmp / f"{name}.log").exists() else ""
    assert f"{name}: 0 of {runs} runs failed" in stdout, (stdout + log)[-4000:]
    assert stdout.count(f"{name} run ") == runs
    assert "terminate called" not in log, log[-4000:]


# Forgetting commopt.shutdown() must not crash either: an atexit hook stops the watchdogs.
NO_SHUTDOWN_SCRIPT = README_SCRIPT.replace(
    "commopt.shutdown()",
    "import threading\nassert any(t.name == 'commopt-watchdog' for t in threading.enumerate())",
)

# overlap=True: the communication thread may still be exchanging the last backward's buckets
# when the script ends (no step() after it, no shutdown()); the optimizer's finalizer joins the
# thread at exit, before the process group is torn down.
OVERLAP_SCRIPT = README_SCRIPT.replace(
    "freeze_step=3)", "freeze_step=3, overlap=True, bucket_numel=20)"
).replace(
    "commopt.shutdown()",
    "loss = model(loader[0]).mean(); loss.backward()  # exchanges start; no step()\n"
    "assert opt.early_work.thread._thread.is_alive()",
)

# The usual dist.destroy_process_group() after commopt.shutdown() raised "Process group
# cannot be None" (exit code 1): shutdown() destroyed init()'s group itself.
ENDINGS = {
    "shutdown-then-destroy": "commopt.shutdown()\ntorch.distributed.destroy_process_group()",
    "destroy-then-shutdown": "torch.distributed.destroy_process_group()\ncommopt.shutdown()",
    "destroy-only": "torch.distributed.destroy_process_group()",
}

OWN_GROUP_SCRIPT = README_SCRIPT.replace(
    "commopt.init()",
    "import warnings\nwarnings.filterwarnings('error', message='.*already initialized')\n"
    "torch.distributed.init_process_group('gloo')\ncommopt.init()",
).replace("commopt.shutdown()", "commopt.shutdown()\ntorch.distributed.destroy_process_group()")

# Every script of this file and its number of runs, all in one launcher (one import of torch
# and commopt).
SCRIPTS: dict[str, tuple[str, int]] = {
    "readme": (README_SCRIPT, RUNS),
    "no_shutdown": (NO_SHUTDOWN_SCRIPT, 6),
    "overlap_in_flight": (OVERLAP_SCRIPT, 6),
    **{name: (README_SCRIPT.replace("commopt.shutdown()", e), 3) for name, e in ENDINGS.items()},
    "own_group": (OWN_GROUP_SCRIPT, 2),
}


@pytest.mark.timeout(900)
def test_readme_script_exits_zero_every_time(launched):
    _assert_every_run_exits_zero(launched, "readme")


@pytest.mark.timeout(900)
def test_script_without_shutdown_exits_zero_too(launched):
    _assert_every_run_exits_zero(launched, "no_shutdown")


@pytest.mark.timeout(900)
def test_overlap_script_exits_zero_with_exchanges_in_flight(launched):
    assert "overlap=True" in OVERLAP_SCRIPT
    _assert_every_run_exits_zero(launched, "overlap_in_flight")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("ending", list(ENDINGS))
def test_teardown_in_either_order_exits_zero(launched, ending):
    _assert_every_run_exits_zero(launched, ending)


@pytest.mark.timeout(900)
def test_init_on_the_users_own_group_does_not_warn(launched):
    _assert_every_run_exits_zero(launched, "own_group")
