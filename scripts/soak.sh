#!/usr/bin/env bash
# Soak: 8 LMCache plugin clients (processes) of mixed store / lookup+load /
# delete against one sidecar on a 16 MiB pool (their keys are 3 x that, so
# eviction runs), every hit's bytes checked. Verdict: 0 errors, 0 wrong bytes,
# no task past its deadline, locks/reservations/pages back to baseline, the
# sidecar's own memory (RssAnon) flat: middle and end <= 1.25 x start + 4 MiB
# (start sampled at steady state: after 10 % of the run and once the removal
# log has filled). docs/FAULTS.md has the figures.
#
#   scripts/soak.sh                   10 minutes
#   scripts/soak.sh --seconds 60      another duration (the CI variant: --short = 45 s)
#   scripts/soak.sh --clients 4       another client count
set -euo pipefail
cd "$(dirname "$0")/.."

args=(--seconds 600)
if [ "${1:-}" = "--short" ]; then
  shift
  args=(--seconds 45)
fi
[ -x .venv/bin/python ] || bash scripts/setup-python.sh
# The plugin as scripts/test-python.sh installs it; on a fresh venv, from
# this checkout's source.
.venv/bin/python -c 'import cxlkv_lmcache' 2>/dev/null || .venv/bin/pip install -q --no-deps ./python
# The sidecar under test: $CXLKV_BIN when the caller built it (scripts/test.sh
# passes the binary its cargo test ran against), else this checkout's debug
# build, cxlkv_testkit.BIN's default.
[ -n "${CXLKV_BIN:-}" ] || cargo build --locked --bin cxlkv
export PYTHONWARNINGS=ignore
echo "== soak: $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null || true)"
exec .venv/bin/python scripts/faults.py soak "${args[@]}" "$@"
