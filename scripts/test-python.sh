#!/usr/bin/env bash
# Python side: build the plugin's wheel, install it into the LMCache venv and
# run its tests (LMCache's own adapter conformance classes included) against
# real sidecars.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup-python.sh
cargo build --locked --bin cxlkv
# The plugin as operators get it: scripts/build-wheels.sh makes the sdist, the
# manylinux wheel with the copy extension (the platform wheel after auditwheel
# repair) and the pure-Python wheel. The tests run against the installed
# manylinux wheel, not the source tree, in a venv of LMCache 0.5.6, its
# dependencies and the test tools only (python/tests/test_packaging.py checks
# the three artifacts and that venv).
dist=target/python-dist
bash scripts/build-wheels.sh "$dist" >/dev/null
.venv/bin/pip install -q --no-deps --force-reinstall "$dist"/cxlkv_lmcache-*-manylinux*.whl
export CXLKV_DIST="$PWD/$dist"
export CXLKV_BIN="$PWD/target/debug/cxlkv"
exec .venv/bin/python -m pytest python/tests -q -p no:cacheprovider "$@"
