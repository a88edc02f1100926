#!/usr/bin/env bash
# The cluster benchmark (`cxlkv-bench cluster`) with each node on cores of
# its own: three sidecars on one shm pool file (a the primary, b and c
# followers), each pinned to NODE_CPUS CPUs (default an eighth of the host),
# the bench's clients on all the CPUs left (five eighths and more). The
# clients need more CPU than the nodes they drive: a lookup costs a client
# about what it costs the node that answers it, so clients on as many cores
# as one node could never show what three nodes serve. The bench reports
# how busy the clients and the busiest node kept their CPUs, and
# `cluster_spread_client_bound` = 1 when the clients were the limit (then
# `cluster_spread_lookup_rate_ratio` is a floor, not what the nodes can do).
# scripts/bench.sh runs the same bench with everything sharing the host's
# cores. Needs 8 CPUs or more and taskset (util-linux).
#
# usage: scripts/bench_cluster.sh [cxlkv-bench cluster options]
#   CXLKV=path/to/cxlkv CXLKV_BENCH=path/to/cxlkv-bench (default: target/release)
#   NODE_CPUS=k: CPUs per node (default nproc/8, at least 1); CLIENTS=m: lookup
#   connections (default four per node CPU)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cxlkv=${CXLKV:-$here/../target/release/cxlkv}
bench=${CXLKV_BENCH:-$here/../target/release/cxlkv-bench}
. "$here/bench_lib.sh"
n=$(nproc)
if [ "$n" -lt 8 ]; then
  echo "bench_cluster: $n CPUs; needs 8 or more (CPUs of its own for each node, more for the clients)" >&2
  exit 2
fi
q=${NODE_CPUS:-$((n / 8))}
[ "$q" -ge 1 ] || q=1
if [ $((3 * q)) -ge $((n - 1)) ]; then
  echo "bench_cluster: NODE_CPUS=$q leaves the clients no CPUs on $n" >&2
  exit 2
fi
cores() { echo "$(($1 * q))-$(($1 * q + q - 1))"; }
clients_cores="$((3 * q))-$((n - 1))"
# Enough requests in flight for every node's cores in either layout: four
# connections per node CPU, each with one lookup in flight at a time.
clients=${CLIENTS:-$((4 * 3 * q))}
tmp=$(mktemp -d)
pool=/dev/shm/cxlkv-bench-cluster-$$
peer=127.0.0.1:$(free_port)
tcp=127.0.0.1:$(free_port)
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
  wait_serving $! "$tmp/$name.sock" "$tmp/$name.log" "bench_cluster: node $name"
}
start a 0 --peer-addr "$peer" --tcp "$tcp" --format
start b 1 --primary-addr "$peer"
start c 2 --primary-addr "$peer"
echo "# $(uname -n), $n CPUs: nodes a/b/c on CPUs $(cores 0), $(cores 1), $(cores 2); $clients clients on $clients_cores"
taskset -c "$clients_cores" "$bench" cluster --primary "$tmp/a.sock" --primary-tcp "$tcp" \
  --followers "$tmp/b.sock,$tmp/c.sock" --pids "$(IFS=,; echo "${pids[*]}")" --clients "$clients" "$@"
