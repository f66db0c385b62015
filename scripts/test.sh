#!/usr/bin/env bash
# The test suite: lint, unit and gloo multi-rank tests, then the MPI tests in one mpiexec job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
. scripts/mpi_env.sh
ruff check commopt tests experiments
python -m pytest -q -p no:cacheprovider
# Every MPI test runs inside this one 4-rank job; a hung job is killed, never waited on.
timeout 600 mpiexec -n 4 python -m pytest -q -p no:cacheprovider tests/multirank/mpi
