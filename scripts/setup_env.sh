#!/usr/bin/env bash
# Create .venv (once) and install commopt with everything the demo and the tests need; an
# argument names more extras for the same pip run (scripts/test.sh: hf,lightning,docs,nvrtc).
# torch is pinned by constraints.txt: an unpinned torch pulls several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x .venv/bin/python ]]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -c constraints.txt -e ".[mpi,dev,experiments${1:+,$1}]"
