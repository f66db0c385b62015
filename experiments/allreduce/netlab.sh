#!/usr/bin/env bash
# Run bench_allreduce.py on 4 emulated hosts joined by links of RATE (netlab, ../shared/netlab).
#
#   sudo bash experiments/allreduce/netlab.sh [RATE] [bench_allreduce.py arguments...]
#   e.g.  bash experiments/allreduce/netlab.sh 1gbit
#         bash experiments/allreduce/netlab.sh 100mbit --reps 3 --methods compressed,fp32
#
# Needs root and iproute2. Each host is a network namespace of this machine, so the processes
# share its filesystem (and its CPUs): the venv's python runs unchanged in every namespace.
# The lab is always taken down again, whatever happens (trap on EXIT).
# Environment: NETLAB (path to the netlab script), NETLAB_PREFIX (default "ar", so as not to
# collide with another lab), PYTHON (default: .venv/bin/python, else the python on PATH),
# BENCH_TIMEOUT (seconds, default 1200).
set -euo pipefail
cd "$(dirname "$0")/../.."
RATE=${1:-1gbit}
shift $(( $# > 0 ? 1 : 0 ))
N=4
NETLAB=${NETLAB:-../shared/netlab/netlab}
export NETLAB_PREFIX=${NETLAB_PREFIX:-ar}
if [[ $(id -u) != 0 ]]; then
  echo "netlab.sh: needs root (network namespaces and tc); run it with sudo" >&2
  exit 2
fi
if [[ ! -x $NETLAB ]]; then
  echo "netlab.sh: netlab not found at $NETLAB; set NETLAB=/path/to/netlab" >&2
  exit 2
fi
if [[ -z ${PYTHON:-} ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=$PWD/.venv/bin/python; else PYTHON=$(command -v python); fi
fi

trap '"$NETLAB" down $N' EXIT
"$NETLAB" down $N  # leftovers of an interrupted run with the same prefix
"$NETLAB" up $N "$RATE"
timeout "${BENCH_TIMEOUT:-1200}" "$NETLAB" run $N "$PYTHON" experiments/allreduce/bench_allreduce.py \
  --label "netlab $N hosts x $RATE" "$@"
