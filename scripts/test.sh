#!/usr/bin/env bash
# Runs every test: Rust (unit, property, integration against the real binary)
# the Python plugin suite (against its built wheel) with LMCache's own adapter
# tests, the operability tests (Prometheus, Kubernetes manifests), a smoke run
# of the benchmarks so they cannot rot, the README's first command run as
# written, and the container image built from the release binary and run.
#
# `scripts/test.sh --fast` runs the Rust stages only (fmt, clippy, cargo test):
# the day-to-day loop, with no venv, no Debian packages and no image. CI and
# the README run the full suite.
set -euo pipefail
cd "$(dirname "$0")/.."

# A clean clone gains nothing from incremental state, most of a debug
# target's size; CI's disk also holds the venv and the release build.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

# Each stage's header says when it started (seconds since the run began) and
# the disk left where the build runs, so a CI log shows where the time and the
# space go (one run failed on a full disk: every test after it could not even
# make its temporary directory).
disk_free() { df -h --output=avail . | tail -1 | tr -d ' '; }
stage() { echo "== [+${SECONDS}s, $(disk_free) free] $*"; }

fast=0
case "${1:-}" in
  --fast) fast=1 ;;
  "") ;;
  *) echo "usage: scripts/test.sh [--fast]" >&2; exit 2 ;;
esac

stage "cargo fmt"
cargo fmt --check

# The failover test runs a real etcd (Debian's etcd-server). Installed before
# the venv build starts below, which may install Debian packages too: apt
# takes one caller at a time.
if [ ! -x /usr/bin/etcd ]; then
  stage "installing Debian's etcd-server (failover tests)"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends etcd-server >/dev/null
fi

# Two slow preparations run in the background, each in its own process group
# (stopped with all it started if this script ends early), and are waited for
# where their result is first needed; their output is printed then.
declare -A bg_pid bg_log
background() { # name log command...
  local name=$1 log=$2
  shift 2
  mkdir -p "$(dirname "$log")"
  stage "$name: started in the background (output: $log)"
  setsid "$@" >"$log" 2>&1 &
  bg_pid[$name]=$!
  bg_log[$name]=$log
}
join() { # name
  local name=$1 status=0
  [ -n "${bg_pid[$name]:-}" ] || return 0
  stage "$name: waiting for the background job"
  wait "${bg_pid[$name]}" || status=$?
  unset "bg_pid[$name]"
  cat "${bg_log[$name]}"
  if [ "$status" != 0 ]; then
    echo "$name failed (exit $status): its output is above" >&2
    exit "$status"
  fi
}
stop_background() {
  local p
  for p in "${bg_pid[@]}"; do kill -- "-$p" 2>/dev/null || true; done
}
trap stop_background EXIT

# The Python venv (a ~6 GB download and unpack: network and disk more than
# CPU) is built while clippy and the test build compile, and waited for
# before any test runs, so no test shares the machine with it.
if [ "$fast" = 0 ]; then
  background "python venv" target/setup-python.log bash scripts/setup-python.sh
fi

# --workspace: the server package and the tool packages under crates/
# (benchmark driver, trace tools).
stage "cargo clippy"
cargo clippy --all-targets --workspace --locked -- -D warnings 2>&1

stage "cargo test: build"
cargo test --all-targets --workspace --locked --no-run 2>&1

# The release build (the bench smoke run, the README's first line and the
# image use it) takes what CPU the test stages leave idle: SCHED_IDLE (nice 19
# where that cannot be set), so a test's processes always run first. Cargo
# locks target/release, not target/debug: no stage waits for it but the bench
# smoke run.
if [ "$fast" = 0 ]; then
  idle=(chrt --idle 0)
  "${idle[@]}" true 2>/dev/null || idle=(nice -n 19)
  background "release build" target/release-build.log \
    "${idle[@]}" ionice -t -c 3 cargo build --release --locked --workspace --bins
fi

join "python venv"

# Includes the fuzz smoke run (tests/fuzz: every target, fixed seed, about
# 1.1 M inputs in all, a minute or so in a debug build on two cores;
# scripts/fuzz.sh runs the long version).
stage "cargo test (with the fuzz smoke run)"
cargo test --all-targets --workspace --locked 2>&1

if [ "$fast" = 1 ]; then
  stage "fast run: Rust stages passed (the full suite adds python, operability, bench smoke, image)"
  echo "suites: 2 passed, 0 failed"
  exit 0
fi

# The sidecar every later stage tests: the binary cargo test built and ran its
# integration tests against. (A plain `cargo build` would build it again with
# other dependency features: cargo adds dev-dependencies' features only to a
# test build.)
sidecar=$PWD/target/debug/cxlkv

stage "python: LMCache plugin and LMCache's own adapter tests"
CXLKV_BIN=$sidecar bash scripts/test-python.sh

# cxlkv's events decoded, converted and indexed by Dynamo's router crate
# (its own workspace: dynamo-kv-router pins a tokio the server cannot use),
# chunks stored through LMCache's in-process engine (the venv above). Built
# in this checkout's target directory: the dependencies both workspaces share
# are built once.
stage "Dynamo's decoder and indexer on cxlkv's events (crates/dynamo-check)"
CXLKV_BIN=$sidecar cargo test --locked --manifest-path crates/dynamo-check/Cargo.toml --target-dir target 2>&1

# Short variants (~3 min together); the full runs and their figures: docs/FAULTS.md.
stage "fault injection and soak (scripts/faults.sh --short, scripts/soak.sh --short)"
CXLKV_BIN=$sidecar bash scripts/faults.sh --short
CXLKV_BIN=$sidecar bash scripts/soak.sh --short

stage "operability: Prometheus, promtool, Kubernetes manifests"
CXLKV_BIN=$sidecar bash scripts/test-ops.sh

join "release build"
stage "benchmark smoke run (scripts/bench.sh --quick; timing is not asserted)"
# Nothing of the run stays behind: its temporary directories and pool files.
leftovers() { ls -d "${TMPDIR:-/tmp}"/cxlkv-bench-* /dev/shm/cxlkv-bench-* 2>/dev/null | sort || true; }
before=$(leftovers)
bash scripts/bench.sh --quick
left=$(comm -13 <(echo "$before") <(leftovers))
[ -z "$left" ] || { echo "the benchmark smoke run left behind:"; echo "$left"; exit 1; }

# The offline GPU host's bundle as shipped, then its run.sh at its defaults
# (1 GiB batches, 7 rounds): CPU only here, so the copy figures without the
# DMA ones, but the same sidecar command line, batch and pin limits, and the
# run must reach its table (a default that the bundle's own sidecar refuses
# once reached a GPU host). Its cluster part needs 8 CPUs and is left out
# (the bench smoke run covers that driver); its sidecar figures
# (bench_host.sh) run quick, as the bundle ships them, after it. About 45 s
# after the release build (pip fetches the cp312 wheels).
stage "GPU bundle: scripts/gpu-bundle.sh, then its run.sh at its defaults (CPU only)"
bash scripts/gpu-bundle.sh target/gpu-bench >/dev/null
py312=${PYTHON312:-$(PYENV_VERSION=3.12.1 pyenv which python3.12 2>/dev/null || command -v python3.12)}
bundle_out=$(CLUSTER=0 HOST=0 PYTHON=$py312 RESULTS=target bash target/gpu-bench/run.sh)
grep -q '^| 32MiB |' <<<"$bundle_out" || { echo "$bundle_out"; echo "the bundle's run did not reach its table"; exit 1; }
host_out=$(CXLKV=target/gpu-bench/bin/cxlkv CXLKV_BENCH=target/gpu-bench/bin/cxlkv-bench bash target/gpu-bench/bench_host.sh --quick)
for f in lookup32_p50_us_rust_tcp storm_reserve_ms storm_reserve_ms_items storm_reserve_ms_follower rebuild_s_per_million_10k registry_lookups_per_s_100k; do
  grep -q "^BENCH $f " <<<"$host_out" || { echo "$host_out"; echo "the bundle's bench_host.sh printed no $f"; exit 1; }
done

# After the bench smoke run, whose release build `cargo run --release` reuses.
# On the default pool, socket and metrics port: no other stage runs meanwhile.
stage "README: its serve line run as written (status, plugin store/load, SIGTERM); its test line is .ci/run's"
bash scripts/test-readme.sh

# After the bench smoke run, whose release build it reuses.
stage "container image: build from the release binary, run cxlkv --version and serve in it"
bash scripts/test-image.sh

# Every stage above runs under `set -e`: reaching this line means all passed.
stage "all suite groups passed: fmt+clippy, cargo test, python, faults+soak, operability, bench smoke, GPU bundle, README, image"
echo "suites: 9 passed, 0 failed"
