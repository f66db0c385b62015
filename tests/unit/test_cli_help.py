"""``commopt --help`` says that tune and bench need a launcher (issue #15, README and CLI)."""

from __future__ import annotations

import pytest

from commopt.cli.main import main
from tests.unit.test_launch import LAUNCH_VARS


def test_help_says_tune_and_bench_need_a_launcher(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "tune and bench measure collectives between ranks, so they run under a launcher" in out
    assert "mpirun -n 4 commopt tune -o table.json" in out
    assert "torchrun --nproc_per_node=4 -m commopt.cli bench" in out
    assert 'eval "$(commopt mpi-env)"' in out  # in the package: an installed user has it
    for name in ("tune", "bench"):
        assert f"(run under a launcher: mpirun -n 4 commopt {name}" in out


def test_version(capsys):
    import commopt

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"commopt {commopt.__version__}"


@pytest.mark.parametrize("command", ["tune", "bench"])
def test_backends_option_lists_its_choices(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--backends BACKENDS restrict to these backends, comma-separated: torch, mpi" in out


def test_bench_report_says_when_every_rank_is_on_one_host():
    from commopt.cli.bench import ONE_HOST_NOTE, report

    rows = [
        {
            "op": op,
            "dtype": "float32",
            "bytes": 1024,
            "backend": "torch",
            "seconds": t,
            "algbw_GBps": 1.0,
            "busbw_GBps": 1.0,
        }
        for op, t in (("all_reduce", 2.0), ("compressed_allreduce", 1.0))
    ]
    assert ONE_HOST_NOTE in report(rows, ["torch"], 2, hosts=1)
    assert ONE_HOST_NOTE not in report(rows, ["torch"], 2, hosts=2)


def test_mpi_env_prints_the_settings_the_checkout_script_sets(capsys, monkeypatch):
    # Issue #38.10: scripts/mpi_env.sh was recommended to users who pip-installed commopt and
    # had no such file; the settings now come from `commopt mpi-env`, which the script evals.
    import os
    import pathlib
    import subprocess
    import sys

    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert main(["mpi-env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "export OMPI_ALLOW_RUN_AS_ROOT=1" in lines
    assert "export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe" in lines
    assert "export OMPI_MCA_btl_tcp_if_include=lo" in lines
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["mpi-env", "--no-loopback"]) == 0
    out = capsys.readouterr().out
    assert "RUN_AS_ROOT" not in out and "tcp_if_include" not in out and "OMP_NUM_THREADS=1" in out
    script = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "mpi_env.sh"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PRTE_"))}
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}:{env.get('PATH', '')}"
    shown = subprocess.run(
        ["bash", "-c", f". {script} && echo $PRTE_MCA_rmaps_default_mapping_policy"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert shown.stdout.strip() == ":oversubscribe", shown.stderr


@pytest.mark.parametrize("command", ["tune", "bench"])
def test_without_a_launcher_the_tools_say_so_and_exit_2(capsys, monkeypatch, command):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    assert main([command]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"commopt {command}: no multi-rank backend in this process; launch it with" in err


@pytest.mark.parametrize(
    ("command", "argv", "message"),
    [
        ("tune", ["--reps", "0"], "argument --reps: expected an integer >= 1, got '0'"),
        ("bench", ["--warmup", "-1"], "argument --warmup: expected an integer >= 0, got '-1'"),
        ("bench", ["--factor", "1"], "argument --factor: expected an integer >= 2, got '1'"),
        ("bench", ["--reps", "x"], "argument --reps: expected an integer >= 1, got 'x'"),
        ("bench", ["--steps", "1"], "argument --steps: expected an integer >= 2, got '1'"),
    ],
)
def test_a_count_out_of_range_is_a_usage_error_before_any_backend_starts(
    capsys, command, argv, message
):
    """``--reps 0`` reached statistics.median deep in the sweep on every rank (a traceback per
    rank, StatisticsError); now argparse refuses it, one line and exit status 2."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, *argv])
    assert exit_info.value.code == 2
    assert f"commopt {command}: error: {message}" in capsys.readouterr().err
