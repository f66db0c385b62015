"""``commopt --help`` says that tune and bench need a launcher (issue #15, README and CLI)."""

from __future__ import annotations

import pytest

from commopt.cli.main import main


def test_help_says_tune_and_bench_need_a_launcher(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "tune and bench measure collectives between ranks, so they run under a launcher" in out
    assert "mpirun -n 4 commopt tune -o table.json" in out
    assert "torchrun --nproc_per_node=4 -m commopt.cli bench" in out
    assert "scripts/mpi_env.sh" in out
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
