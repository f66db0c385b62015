"""The ``commopt`` command and its subcommand registry.

A subcommand is a module with ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. It is listed in :data:`SUBCOMMANDS` (name → module path) or added at run
time with :func:`register`; modules are imported only when their subcommand runs, so
``commopt --help`` stays fast and a subcommand's optional dependencies stay optional.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from types import ModuleType

from commopt._version import __version__

__all__ = ["SUBCOMMANDS", "main", "register"]

#: name → module implementing it
SUBCOMMANDS: dict[str, str] = {
    "tune": "commopt.cli.tune",
    "bench": "commopt.cli.bench",
    "mpi-env": "commopt.cli.mpi_env",
}

_HELP = {
    "tune": "measure collectives on every backend and write a MixedBackend selection table "
    "(run under a launcher: mpirun -n 4 commopt tune -o table.json)",
    "bench": "time, algorithm and bus bandwidth of every collective on every backend "
    "(run under a launcher: mpirun -n 4 commopt bench, or torchrun ... -m commopt.cli bench)",
    "mpi-env": "print the Open MPI settings for several ranks on one machine as shell exports "
    '(eval "$(commopt mpi-env)")',
}

_EPILOG = (
    "tune and bench measure collectives between ranks, so they run under a launcher, one "
    "process per rank: 'mpirun -n 4 commopt tune -o table.json' (torch and MPI backends) or "
    "'torchrun --nproc_per_node=4 -m commopt.cli bench' (torch only). Run without a "
    "launcher they stop with exit status 2 and say so. As root, or with more ranks than "
    "cores, run 'eval \"$(commopt mpi-env)\"' first (Open MPI's consent to run as root, and "
    "oversubscription)."
)


def register(name: str, module: str, help: str = "") -> None:
    """Add (or replace) subcommand ``name``, implemented by the module path ``module``."""
    if not name or name.startswith("-"):
        raise ValueError(f"subcommand name must be a non-empty word, got {name!r}")
    SUBCOMMANDS[name] = module
    _HELP[name] = help


def _load(name: str) -> ModuleType:
    mod = importlib.import_module(SUBCOMMANDS[name])
    for attr in ("add_arguments", "run"):
        if not callable(getattr(mod, attr, None)):
            raise TypeError(f"subcommand {name!r}: module {mod.__name__} has no {attr}()")
    return mod


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``commopt`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="commopt",
        description="commopt: communication-compressed optimizers — tools",
        epilog=_EPILOG,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--version", action="version", version=f"commopt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name in SUBCOMMANDS:
        p = sub.add_parser(name, help=_HELP.get(name, ""), description=_HELP.get(name, ""))
        p.add_argument(
            "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log at INFO"
        )
        if name == wanted:  # import only the subcommand that runs
            _load(name).add_arguments(p)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    return int(_load(args.command).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
