#!/usr/bin/env bash
# The sidecar's own figures on a host (built into scripts/gpu-bundle.sh's
# bundle, which has no Python benchmark driver for them): the control path
# (`cxlkv-bench control`, UDS and TCP), a storm of reserves that cannot be
# placed over 50,000 locked entries beside a probe (`storm`, configured as
# scripts/bench.py configures it; on one node, then through a follower), the warm restart of a million objects
# (`rebuild`) and the registry at ten million entries (`scale`). Each prints
# its BENCH lines as scripts/bench.sh does, so a host's figures compare with
# docs/BENCHMARKS.md's.
#
# usage: scripts/bench_host.sh [--quick]
#   CXLKV=path/to/cxlkv CXLKV_BENCH=path/to/cxlkv-bench (default: target/release)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cxlkv=${CXLKV:-$here/../target/release/cxlkv}
bench=${CXLKV_BENCH:-$here/../target/release/cxlkv-bench}
. "$here/bench_lib.sh"
quick=0
[ "${1:-}" = --quick ] && quick=1
tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$tmp" /dev/shm/cxlkv-bench-host-$$-*
}
trap cleanup EXIT

start() { # name size region page config-toml [extra args...]; POOL=name: on another's pool, unformatted
  local name=$1 size=$2 region=$3 page=$4 cfg=$5 fmt=(--format)
  shift 5
  [ -n "${POOL:-}" ] && fmt=()
  printf '%s' "$cfg" >"$tmp/$name.toml"
  "$cxlkv" serve --pool-path "/dev/shm/cxlkv-bench-host-$$-${POOL:-$name}" --pool-size "$size" --region-size "$region" \
    --page-size "$page" --metrics-addr "" --socket "$tmp/$name.sock" --config "$tmp/$name.toml" "${fmt[@]}" "$@" \
    2>"$tmp/$name.log" &
  pids+=($!)
  wait_serving $! "$tmp/$name.sock" "$tmp/$name.log" "bench_host: sidecar $name"
}
stop_all() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  pids=()
}

# Control path over UDS and TCP.
tcp=127.0.0.1:$(free_port)
start ctl 512MiB 256MiB 4KiB "" --tcp "$tcp"
if [ $quick = 1 ]; then it=(--iters 300 --seconds 0.3); else it=(--iters 20000 --seconds 3); fi
"$bench" control --socket "$tmp/ctl.sock" --tcp "$tcp" "${it[@]}"
stop_all

# The storm, as scripts/bench.py runs it: admission off, another client's
# locks on every region (its pin limit the whole pool), a control sidecar
# the storm never calls, probed in turn.
storm_cfg=$'[registry]\nadmission = "off"\nmax_client_pinned_bytes = 268435456\n'
# Its items packed (as the plugin sends a batch), then as one message each
# (figures ending in _items): what the request's form costs.
if [ $quick = 1 ]; then st=(--locked 5000 --free 1000 --probes 200); else st=(--locked 50000 --free 10000 --probes 2000); fi
# As many 64 MiB regions as the entries fill (256 MiB for 60,000): the
# storm stops at a reserve that is placed.
regions=$(( (st[1] + st[3] + 16383) / 16384 ))
for form in "" --items; do
  start storm "$((64 * regions))MiB" 64MiB 4KiB "$storm_cfg"
  start storm-control "$((64 * regions))MiB" 64MiB 4KiB "$storm_cfg"
  "$bench" storm --socket "$tmp/storm.sock" --control-socket "$tmp/storm-control.sock" "${st[@]}" $form
  stop_all
done

# The storm through a follower, as scripts/bench.py runs it: a primary and
# a follower on one pool with a region more for the primary, whose region
# keeps a locked entry of its own (--hold-socket).
peer=127.0.0.1:$(free_port)
start fstorm-a "$((64 * (regions + 1)))MiB" 64MiB 4KiB "$storm_cfg" --primary a --node-name a --peer-addr "$peer"
POOL=fstorm-a start fstorm-b "$((64 * (regions + 1)))MiB" 64MiB 4KiB "$storm_cfg" --primary a --node-name b \
  --primary-addr "$peer"
"$bench" storm --socket "$tmp/fstorm-b.sock" --hold-socket "$tmp/fstorm-a.sock" --suffix _follower "${st[@]}"
kill "${pids[1]}" && wait "${pids[1]}" 2>/dev/null || true # the follower first: it never waits on a gone primary
stop_all

# Warm restart and registry scale (no sidecar: the bench builds its own).
for n in $([ $quick = 1 ] && echo 10000 || echo 100000 1000000); do
  "$bench" rebuild --pool "/dev/shm/cxlkv-bench-host-$$-rebuild" --objects "$n"
done
for n in $([ $quick = 1 ] && echo 100000 || echo 10000000); do
  "$bench" scale --entries "$n" --seconds "$([ $quick = 1 ] && echo 0.5 || echo 3)"
done
