"""``commopt mpi-env``: the Open MPI settings for a few ranks on one small machine, as shell.

Open MPI refuses to run as root without consent and to start more ranks than cores without
oversubscription; on one machine its TCP transport should stay on loopback, and each rank
should use one thread and yield the core while it waits (with more ranks than cores, ranks
polling in MPI starve the ones still computing). ``eval "$(commopt mpi-env)"`` sets all of that
in the current shell; the checkout's ``scripts/mpi_env.sh`` does exactly this.
"""

from __future__ import annotations

import argparse
import os
import shlex

__all__ = ["HELP", "add_arguments", "run", "settings"]

HELP = (
    "print the Open MPI settings for several ranks on one machine (root, oversubscription, "
    'loopback, one thread per rank) as shell exports: eval "$(commopt mpi-env)"'
)


def settings(*, root: bool, loopback: bool = True) -> dict[str, str]:
    """The environment variables, by name (``root``: add Open MPI's consent to run as root)."""
    env = {}
    if root:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env["PRTE_MCA_rmaps_default_mapping_policy"] = ":oversubscribe"
    env["OMPI_MCA_btl"] = "self,tcp"
    if loopback:
        env["OMPI_MCA_btl_tcp_if_include"] = "lo"
    env["OMP_NUM_THREADS"] = "1"
    env["OMPI_MCA_mpi_yield_when_idle"] = "1"
    return env


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``commopt mpi-env`` options."""
    parser.add_argument(
        "--no-loopback",
        dest="loopback",
        action="store_false",
        help="leave Open MPI's TCP interfaces alone (ranks on several hosts)",
    )


def run(args: argparse.Namespace) -> int:
    """Print the environment lines for Open MPI from the wheel."""
    for name, value in settings(root=os.geteuid() == 0, loopback=args.loopback).items():
        print(f"export {name}={shlex.quote(value)}")
    return 0
