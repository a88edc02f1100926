#!/usr/bin/env bash
# The cluster benchmark (`cxlkv-bench cluster`) with each node on cores of
# its own: three sidecars on one shm pool file (a the primary, b and c
# followers), each pinned to a quarter of the CPUs, the bench's clients on
# the last quarter. scripts/bench.sh runs the same bench with everything
# sharing the host's cores; on a host with few cores that cannot show what
# spreading clients over nodes gives (`cluster_spread_lookup_rate_ratio`),
# this can. Needs 8 CPUs or more and taskset (util-linux).
#
# usage: scripts/bench_cluster.sh [cxlkv-bench cluster options]
#   CXLKV=path/to/cxlkv CXLKV_BENCH=path/to/cxlkv-bench (default: target/release)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cxlkv=${CXLKV:-$here/../target/release/cxlkv}
bench=${CXLKV_BENCH:-$here/../target/release/cxlkv-bench}
n=$(nproc)
if [ "$n" -lt 8 ]; then
  echo "bench_cluster: $n CPUs; needs 8 or more (a quarter for each node and for the clients)" >&2
  exit 2
fi
q=$((n / 4))
cores() { echo "$(($1 * q))-$(($1 * q + q - 1))"; }
tmp=$(mktemp -d)
pool=/dev/shm/cxlkv-bench-cluster-$$
peer=127.0.0.1:$((20000 + $$ % 20000))
tcp=127.0.0.1:$((40000 + $$ % 20000))
pids=()
cleanup() {
  # Followers first: none of them waits on a gone primary.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill "${pids[$i]}" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$tmp" "$pool"
}
trap cleanup EXIT

start() { # name core-slot extra args...
  local name=$1 slot=$2
  shift 2
  taskset -c "$(cores "$slot")" "$cxlkv" serve --pool-path "$pool" --pool-size 512MiB --region-size 64MiB \
    --page-size 4KiB --metrics-addr "" --primary a --node-name "$name" --socket "$tmp/$name.sock" "$@" \
    2>"$tmp/$name.log" &
  pids+=($!)
  for _ in $(seq 600); do
    [ -S "$tmp/$name.sock" ] && return 0
    kill -0 "${pids[-1]}" 2>/dev/null || break
    sleep 0.1
  done
  echo "bench_cluster: node $name did not start:" >&2
  tail -20 "$tmp/$name.log" >&2
  exit 1
}
start a 0 --peer-addr "$peer" --tcp "$tcp" --format
start b 1 --primary-addr "$peer"
start c 2 --primary-addr "$peer"
echo "# $(uname -n), $n CPUs: nodes a/b/c on CPUs $(cores 0), $(cores 1), $(cores 2); clients on $(cores 3)"
taskset -c "$(cores 3)" "$bench" cluster --primary "$tmp/a.sock" --primary-tcp "$tcp" \
  --followers "$tmp/b.sock,$tmp/c.sock" --pids "$(IFS=,; echo "${pids[*]}")" --clients $((2 * q)) "$@"
