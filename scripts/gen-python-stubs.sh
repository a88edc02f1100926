#!/usr/bin/env bash
# Regenerate the Python gRPC stubs from proto/ into python/cxlkv_lmcache/_proto
# (or into $1). Uses grpcio-tools pinned to LMCache's grpcio version.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-python}"
py="${PYTHON:-.venv/bin/python}"
mkdir -p "$out/cxlkv_lmcache/_proto"
"$py" -m grpc_tools.protoc -Icxlkv_lmcache/_proto=proto \
  --python_out="$out" --grpc_python_out="$out" proto/cxlkv.proto
touch "$out/cxlkv_lmcache/_proto/__init__.py"
