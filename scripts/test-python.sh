#!/usr/bin/env bash
# Python side: install the plugin into the LMCache venv and run its tests
# (LMCache's own adapter conformance classes included) against real sidecars.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup-python.sh
cargo build --locked --bin cxlkv
.venv/bin/pip install -q --no-deps --force-reinstall ./python
export CXLKV_BIN="$PWD/target/debug/cxlkv"
exec .venv/bin/python -m pytest python/tests -q -p no:cacheprovider "$@"
