#!/usr/bin/env bash
# The test suite: lint, unit and gloo multi-rank tests, then the MPI tests in one mpiexec job.
set -euo pipefail
cd "$(dirname "$0")/.."
# The framework examples' tests need transformers, accelerate and Lightning, the API reference
# mkdocs, the CUDA compile test NVRTC and ptxas (~130 MB of wheels); the demo needs none of them.
bash scripts/setup_env.sh hf,lightning,docs,nvrtc
. .venv/bin/activate
. scripts/mpi_env.sh
# g++ compiles cuda/*.cu for the CPU (tests/cuda_on_cpu): the CUDA kernels execute in CI.
command -v g++ >/dev/null || { apt-get update -qq && apt-get install -y -qq g++; }
ruff check commopt tests experiments examples
ruff format --check commopt tests experiments examples
# The documentation site with its API reference from the docstrings; any warning fails.
mkdocs build --strict --quiet
# Two pytest workers (pytest-xdist), each test file on one worker: a third of the run is
# single-threaded (subprocess imports, rank start-up, waits), which the other worker fills.
python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=25
# Every MPI test runs inside this one 4-rank job; a hung job is killed, never waited on.
timeout 600 mpiexec -n 4 python -u -m pytest -q -p no:cacheprovider --color=no tests/multirank/mpi
# The release: sdist and wheel built and checked, the wheel installed in a fresh venv, the
# README's "Use" snippet run from it on 2 ranks.
bash scripts/check_release.sh
