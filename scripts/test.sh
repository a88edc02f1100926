#!/usr/bin/env bash
# Runs every test: Rust (unit, property, integration against the real binary)
# and, when present, the Python plugin suite with LMCache's own adapter tests.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt"
cargo fmt --check

echo "== cargo clippy"
cargo clippy --all-targets --locked -- -D warnings 2>&1

echo "== cargo test"
cargo test --all-targets --locked 2>&1

if [ -f scripts/test-python.sh ]; then
  echo "== python"
  bash scripts/test-python.sh
fi
