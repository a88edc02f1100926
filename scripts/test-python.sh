#!/usr/bin/env bash
# Python side: build the plugin's wheel, install it into the LMCache venv and
# run its tests against real sidecars: the multiprocess server's L2 adapter
# (LMCache's own adapter conformance classes included) and the in-process
# engine's storage backend and remote connector (test_inproc_*.py; LMCache's
# own test_storage_plugin / test_remote_storage_plugin loader tests and the
# test_maru_backend scenarios pointed at them: test_lmcache_inproc_conformance.py).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup-python.sh
# The sidecar under test: $CXLKV_BIN when the caller built it (scripts/test.sh
# passes the binary its cargo test ran against), else this checkout's debug
# build, cxlkv_testkit.BIN's default.
[ -n "${CXLKV_BIN:-}" ] || cargo build --locked --bin cxlkv
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
# A passed test's tmp_path (its pool file, logs, an etcd's preallocated WAL)
# goes when the test ends, a failed one's stays for its post-mortem: the suite
# needs the disk of its largest test, not of all of them (about 1.3 GB).
exec .venv/bin/python -m pytest python/tests -q -p no:cacheprovider -o tmp_path_retention_policy=failed "$@"
