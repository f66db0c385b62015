#!/usr/bin/env bash
# Step time of DDP (fp32, fp16 hook, PowerSGD) and the commopt optimizers on 4 emulated hosts.
#
#   bash experiments/tcp/run.sh [RATE] [bench.py arguments...]     (as root)
#   e.g.  bash experiments/tcp/run.sh 1gbit
#         bash experiments/tcp/run.sh 100mbit --measure 16
#
# Brings up netlab (../shared/netlab) with 4 hosts joined by full-duplex links of RATE, runs
# experiments/tcp/bench.py once per host (torchrun-style environment, gloo over eth0) and always
# takes the lab down again (trap on EXIT). Results: experiments/tcp/results/RATE.md and .json.
# Environment: NETLAB (path to netlab), NETLAB_PREFIX (default "tcpx"), PYTHON (default: the
# python on PATH), BENCH_TIMEOUT (seconds, default 1800), MASTER_PORT (default 29640).
set -euo pipefail
cd "$(dirname "$0")/../.."
RATE=${1:-1gbit}
shift $(( $# > 0 ? 1 : 0 ))
N=4
NETLAB=${NETLAB:-$(realpath -m ../shared/netlab/netlab)}
[[ -x $NETLAB ]] || NETLAB=/work/shared/netlab/netlab
export NETLAB_PREFIX=${NETLAB_PREFIX:-tcpx}
export MASTER_PORT=${MASTER_PORT:-29640}
if [[ $(id -u) != 0 ]]; then
  echo "run.sh: needs root (network namespaces and tc); run it with sudo" >&2
  exit 2
fi
if [[ ! -x $NETLAB ]]; then
  echo "run.sh: netlab not found; set NETLAB=/path/to/netlab" >&2
  exit 2
fi
PYTHON=${PYTHON:-$(command -v python)}
mkdir -p experiments/tcp/results
trap '"$NETLAB" down $N' EXIT
"$NETLAB" down $N  # leftovers of an interrupted run with the same prefix
"$NETLAB" up $N "$RATE"
timeout "${BENCH_TIMEOUT:-1800}" "$NETLAB" run $N "$PYTHON" -m experiments.tcp.bench \
  --label "netlab: $N hosts, full-duplex $RATE links" \
  --out "experiments/tcp/results/$RATE.md" --json "experiments/tcp/results/$RATE.json" "$@"
