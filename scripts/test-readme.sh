#!/usr/bin/env bash
# The README's first code block as written (scripts/test_readme.py): its first
# line, `cargo run --release -- serve`, is run until the sidecar is ready on
# the embedded defaults, checked with `cxlkv status` and a store and a load
# through the plugin installed in .venv, and stopped with SIGTERM; its second
# line must be what .ci/run runs. A stage of scripts/test.sh after the bench
# smoke run, whose release build `cargo run --release` then reuses (run alone
# on a fresh clone, it compiles the release build first).
#
# It uses the default pool, socket and metrics port (/dev/shm/cxlkv-pool,
# /tmp/cxlkv/cxlkv.sock, 127.0.0.1:9464): do not run it beside anything else
# that uses them (the test refuses to start if they are taken).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup-python.sh
# The plugin as the earlier stages left it in .venv (the manylinux wheel, or
# bench.sh's build of ./python); a venv without it gets the source build.
.venv/bin/python -c 'import cxlkv_lmcache' 2>/dev/null || .venv/bin/pip install -q --no-deps ./python
exec .venv/bin/python -m pytest scripts/test_readme.py -q -p no:cacheprovider -o tmp_path_retention_policy=failed "$@"
