#!/usr/bin/env bash
# Runs every test: Rust (unit, property, integration against the real binary)
# the Python plugin suite with LMCache's own adapter tests, and the
# operability tests (Prometheus, Kubernetes manifests), and a smoke run of the
# benchmarks so they cannot rot.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt"
cargo fmt --check

echo "== cargo clippy"
cargo clippy --all-targets --locked -- -D warnings 2>&1

echo "== cargo test"
cargo test --all-targets --locked 2>&1

echo "== python: LMCache plugin and LMCache's own adapter tests"
bash scripts/test-python.sh

echo "== operability: Prometheus, promtool, Kubernetes manifests"
bash scripts/test-ops.sh

echo "== benchmark smoke run (scripts/bench.sh --quick; timing is not asserted)"
bash scripts/bench.sh --quick

# Every stage above runs under `set -e`: reaching this line means all passed.
echo "== all suite groups passed: fmt+clippy, cargo test, python, operability, bench smoke"
echo "suites: 5 passed, 0 failed"
