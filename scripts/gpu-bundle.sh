#!/usr/bin/env bash
# Packs the copy-path benchmark (scripts/bench_copy.py) for an offline GPU
# host that has Python 3.12 and torch (with CUDA) but no cargo, grpcio,
# protobuf or LMCache, and no network:
#
#   OUT/bin/cxlkv        the stripped release sidecar
#   OUT/bin/cxlkv-bench  the stripped cluster benchmark, and
#   OUT/bench_cluster.sh which runs it with each node on cores of its own
#   OUT/bench_host.sh    the sidecar's control path, reserve storm, warm
#                        restart and registry scale on this host
#   OUT/bench_lib.sh     what those two share (starting a sidecar, a free port)
#   OUT/wheels/          the plugin as a cp312 manylinux wheel (its streaming-copy
#                        extension compiled for 3.12), grpcio and protobuf for
#                        cp312 manylinux x86_64, and what they depend on
#   OUT/bench_copy.py    the benchmark, and
#   OUT/cxlkv_testkit/   the test kit it starts its sidecar with, and
#   OUT/bench_gpu_direct.py  GPU-direct stores and loads (DMA to and from the
#                        pool's pages, RPCs pipelined behind the copies)
#   OUT/run.sh           installs the wheels into OUT/site (no index) and runs
#                        the benchmark, its output kept in a results file
#
# and OUT.tar.gz of the same. Needs network here (pip fetches the wheels and
# the plugin's build backend) and a Python 3.12 with pip: $PYTHON312, else
# pyenv's 3.12.1, else python3.12 on PATH.
#
# usage: scripts/gpu-bundle.sh [OUT]        (default target/gpu-bench)
# there: bash run.sh [bench_copy.py options] (see run.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:-target/gpu-bench}
# The versions the plugin's tests run with (scripts/setup-python.sh's venv,
# from lmcache 0.5.6); the generated stubs need grpcio >= 1.78, protobuf 6.
PINS=(grpcio==1.78.0 protobuf==6.33.6)

py=${PYTHON312:-}
if [ -z "$py" ]; then
  py=$(PYENV_VERSION=3.12.1 pyenv which python3.12 2>/dev/null || command -v python3.12 || true)
fi
if [ -z "$py" ] || [ "$("$py" -c 'import sys; print(sys.version_info[:2] == (3, 12))')" != True ]; then
  echo "gpu-bundle: needs a Python 3.12 (set PYTHON312=/path/to/python3.12)" >&2
  exit 2
fi

cargo build --release --locked --workspace --bin cxlkv --bin cxlkv-bench
rm -rf "$out" "$out.tar.gz"
mkdir -p "$out/bin" "$out/wheels"
strip -o "$out/bin/cxlkv" target/release/cxlkv
strip -o "$out/bin/cxlkv-bench" target/release/cxlkv-bench

quiet() { # pip's progress only when it fails
  local log; log=$(mktemp)
  if ! "$@" >"$log" 2>&1; then cat "$log" >&2; rm -f "$log"; return 1; fi
  rm -f "$log"
}
# The plugin as it ships (scripts/build-wheels.sh), its manylinux wheel for
# 3.12; the script fails on a wheel without the compiled extension, which
# would measure ctypes.memmove, not the plugin.
plugin_dist=$(mktemp -d)
PYTHON="$py" bash scripts/build-wheels.sh "$plugin_dist" >/dev/null
mv "$plugin_dist"/cxlkv_lmcache-*-cp312-cp312-manylinux*.whl "$out/wheels/"
rm -rf "$plugin_dist"
quiet "$py" -m pip download --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 -d "$out/wheels" "${PINS[@]}"

cp scripts/bench_copy.py scripts/bench_gpu_direct.py scripts/bench_cluster.sh scripts/bench_host.sh scripts/bench_lib.sh "$out/"
# The test kit's sidecar launcher, which bench_copy.py starts its sidecar
# with: the package beside the scripts (their directory is first on the
# import path); its modules import only the standard library until used.
mkdir -p "$out/cxlkv_testkit"
cp python/testkit/cxlkv_testkit/*.py "$out/cxlkv_testkit/"
cat > "$out/run.sh" <<'EOF'
#!/usr/bin/env bash
# cxlkv copy-path benchmark on this host (built by scripts/gpu-bundle.sh).
# Needs Python 3.12 (the wheels are cp312) and, for the GPU figures, torch
# with CUDA; nothing is fetched. The wheels go into ./site (or $SITE) once,
# with pip if this Python has it, else unpacked (a wheel is a zip laid out
# the way site-packages wants it).
#
# usage: bash run.sh [bench_copy.py options]
#   bash run.sh                       # 1 GiB batches, 7 rounds, 2 MiB and 32 MiB objects
#   bash run.sh --quick               # seconds-long check that everything works
#   PYTHON=/usr/bin/python3.12 bash run.sh --copy-threads 4
# Then, with CUDA, GPU-direct stores and loads (bench_gpu_direct.py), and on
# 8 CPUs or more the cluster benchmark with each node on cores of its own
# (bench_cluster.sh; CLUSTER=0 skips it), then the sidecar's own figures
# (bench_host.sh: control path, reserve storm, warm restart, registry scale;
# HOST=0 skips them).
# The output is also written to bench-copy-HOST-TIME.txt here (or in $RESULTS).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
if [ "$("$py" -c 'import sys; print(sys.version_info[:2] == (3, 12))')" != True ]; then
  echo "run.sh: $py is not Python 3.12; set PYTHON=/path/to/python3.12" >&2
  exit 2
fi
site=${SITE:-$here/site}
if [ ! -d "$site/cxlkv_lmcache" ]; then
  if "$py" -m pip --version >/dev/null 2>&1; then
    "$py" -m pip install -q --no-index --find-links "$here/wheels" --target "$site" cxlkv-lmcache
  else
    for w in "$here"/wheels/*.whl; do "$py" -m zipfile -e "$w" "$site"; done
  fi
fi
"$here/bin/cxlkv" --version  # fails here, not mid-run, if this host's glibc is too old for it
results=${RESULTS:-$here}/bench-copy-$(uname -n)-$(date -u +%Y%m%dT%H%M%SZ).txt
{
  echo "# $(uname -n), $(nproc) CPUs, $(uname -r), $(date -u +%FT%TZ)"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sed 's/^/# /' || true
  fi
  PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" "$py" "$here/bench_copy.py" --cxlkv "$here/bin/cxlkv" "$@" 2>&1
  # GPU-direct (needs CUDA; says so and skips without it).
  quick=()
  case " $* " in *" --quick "*) quick=(--quick) ;; esac
  PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" "$py" "$here/bench_gpu_direct.py" --cxlkv "$here/bin/cxlkv" \
    "${quick[@]}" 2>&1
  if [ "${CLUSTER:-1}" != 0 ] && [ "$(nproc)" -ge 8 ]; then
    quick=()
    case " $* " in *" --quick "*) quick=(--iters 200 --objects 64 --rounds 4 --seconds 0.3) ;; esac
    CXLKV="$here/bin/cxlkv" CXLKV_BENCH="$here/bin/cxlkv-bench" bash "$here/bench_cluster.sh" "${quick[@]}" 2>&1
  fi
  if [ "${HOST:-1}" != 0 ]; then
    quick=()
    case " $* " in *" --quick "*) quick=(--quick) ;; esac
    CXLKV="$here/bin/cxlkv" CXLKV_BENCH="$here/bin/cxlkv-bench" bash "$here/bench_host.sh" "${quick[@]}" 2>&1
  fi
} | tee "$results"
echo "results: $results"
EOF
chmod +x "$out/run.sh" "$out/bench_copy.py" "$out/bench_gpu_direct.py"

tar -czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
echo "bundle: $out ($(du -sh "$out" | cut -f1)), $out.tar.gz ($(du -sh "$out.tar.gz" | cut -f1))"
ls -l "$out/bin" "$out/wheels"
