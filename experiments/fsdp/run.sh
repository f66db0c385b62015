#!/usr/bin/env bash
# Step time of HSDP + AdamW (FSDP2's native 2-D mesh) and HSDP + 1-bit Adam (commopt.fsdp) on
# 2 emulated hosts × 2 ranks: shard inside a host, replicate across the RATE link.
#
#   bash experiments/fsdp/run.sh [RATE] [bench.py speed arguments...]     (as root)
#   e.g.  bash experiments/fsdp/run.sh 1gbit
#
# Brings up netlab (../shared/netlab) with 2 hosts, starts 2 ranks on each
# (NETLAB_RANKS_PER_HOST=2; ranks of a host talk over its unshaped loopback) and always takes
# the lab down again. Results: experiments/fsdp/results/speed-RATE.md and .json.
set -euo pipefail
cd "$(dirname "$0")/../.."
RATE=${1:-1gbit}
shift $(( $# > 0 ? 1 : 0 ))
N=2
NETLAB=${NETLAB:-$(realpath -m ../shared/netlab/netlab)}
[[ -x $NETLAB ]] || NETLAB=/work/shared/netlab/netlab
export NETLAB_PREFIX=${NETLAB_PREFIX:-fsdpx}
export MASTER_PORT=${MASTER_PORT:-29660}
if [[ $(id -u) != 0 ]]; then
  echo "run.sh: needs root (network namespaces and tc); run it with sudo" >&2
  exit 2
fi
PYTHON=${PYTHON:-$(command -v python)}
mkdir -p experiments/fsdp/results
trap '"$NETLAB" down $N' EXIT
"$NETLAB" down $N
"$NETLAB" up $N "$RATE"
NETLAB_RANKS_PER_HOST=2 timeout "${BENCH_TIMEOUT:-1800}" "$NETLAB" run $N "$PYTHON" -m \
  experiments.fsdp.bench speed --ranks-per-host 2 \
  --label "netlab: $N hosts × 2 ranks, full-duplex $RATE links between hosts" \
  --out "experiments/fsdp/results/speed-$RATE.md" "$@"
