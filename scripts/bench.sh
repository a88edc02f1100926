#!/usr/bin/env bash
# All cxlkv benchmarks in one go: memcpy limit, the data path through LMCache's
# adapter interface against LMCache's Redis (resp) and dax adapters, control
# path, registry scale, eviction cost, restart, storms, coherence, a
# three-node cluster on one pool. Full mode writes docs/BENCHMARKS.md;
# --quick is a seconds-long smoke run (part of scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup-python.sh
if ! command -v redis-server >/dev/null; then
  echo "== installing Debian's redis-server package"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq redis-server >/dev/null
fi
cargo build --release --locked --workspace --bins
.venv/bin/pip install -q --no-deps --force-reinstall ./python
.venv/bin/python scripts/bench.py "$@"
# The event plane (#37); after bench.py, which rewrites docs/BENCHMARKS.md: this adds its section.
exec .venv/bin/python scripts/bench_events.py "$@"
