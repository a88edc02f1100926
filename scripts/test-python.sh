#!/usr/bin/env bash
# Python side: build the plugin's wheel, install it into the LMCache venv and
# run its tests (LMCache's own adapter conformance classes included) against
# real sidecars.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup-python.sh
cargo build --locked --bin cxlkv
# The plugin as operators get it: `python -m build` makes the sdist and, from
# it, the platform wheel with the copy extension; a pure-Python wheel is built
# too. The tests run against the installed platform wheel, not the source tree
# (python/tests/test_packaging.py checks all three artifacts).
quiet() { # the builder's progress only when it fails
  local log; log=$(mktemp)
  if ! "$@" >"$log" 2>&1; then cat "$log" >&2; rm -f "$log"; return 1; fi
  rm -f "$log"
}
dist=target/python-dist
rm -rf "$dist"
quiet .venv/bin/python -m build python --outdir "$dist"
CXLKV_LMCACHE_PURE=1 quiet .venv/bin/python -m build --wheel python --outdir "$dist/pure"
.venv/bin/pip install -q --no-deps --force-reinstall "$dist"/cxlkv_lmcache-*-cp*.whl
export CXLKV_DIST="$PWD/$dist"
export CXLKV_BIN="$PWD/target/debug/cxlkv"
exec .venv/bin/python -m pytest python/tests -q -p no:cacheprovider "$@"
