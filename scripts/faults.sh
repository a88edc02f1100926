#!/usr/bin/env bash
# Fault injection against a real sidecar through the LMCache plugin: LMCache's
# fault_inject L2 wrapper at 10 % (also under `lmcache bench l2`, 32 submits in
# flight), kill -9 of the sidecar under load and restart, SIGSTOP/SIGCONT
# under load, clients killed with -9 mid-copy, three nodes on one pool with
# clients reading across nodes while they evict, and the same three nodes
# electing their primary through a real etcd while the primary is killed (-9)
# and the next one stopped (SIGSTOP) under that load, and the cluster under
# random faults (cluster-chaos: follower and primary stops and kills, nodes
# declared dead while their writers copy, deletes racing a primary restart,
# phase-3 reclaims). Each scenario prints a VERDICT line (0 wrong bytes, no
# task past its deadline, locks/reservations/pages back to baseline;
# cluster-chaos also 0 resurrected deletes and no node stuck); any FAIL makes
# this exit 1. docs/FAULTS.md has the figures.
#
#   scripts/faults.sh            the full run (~6 min here)
#   scripts/faults.sh --short    the CI variant (~2-3 min of scenarios)
#   extra arguments go to scripts/faults.py (e.g. kill9 --seconds 60)
#   scripts/faults.sh cluster-chaos --seconds 600    the long chaos run
#   scripts/faults.sh cluster-chaos --seed 7         one sequence of faults again
set -euo pipefail
cd "$(dirname "$0")/.."

args=(--rounds 40 --seconds 60 --kills 5)
if [ "${1:-}" = "--short" ]; then
  shift
  args=(--rounds 4 --seconds 9 --kills 2)
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
echo "== faults: $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null || true)"
exec .venv/bin/python scripts/faults.py "${args[@]}" "$@"
