#!/usr/bin/env bash
# Container image: build it from the release binary (scripts/build-image.sh
# --prebuilt, no registry needed) and run tests/image against it: the
# Containerfile's entrypoint/user/ports, `cxlkv --version`, and `cxlkv serve`
# as deployed (socket, gRPC health, /ready, SIGTERM drain). Uses docker when
# its daemon answers, else podman (installs Debian's podman and runc if
# neither is present). Expects scripts/setup-python.sh's venv.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup-python.sh
if command -v docker >/dev/null && docker info >/dev/null 2>&1; then engine=docker
else
  engine=podman
  # runc: crun cannot run containers on cgroup v1/hybrid hosts such as CI's VMs.
  if ! command -v podman >/dev/null || ! command -v runc >/dev/null; then
    echo "== installing Debian's podman and runc"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends podman runc >/dev/null
  fi
fi
ref=$(ENGINE=$engine bash scripts/build-image.sh --prebuilt | tail -n1)
echo "== built $ref with $engine"
export CXLKV_ENGINE=$engine CXLKV_IMAGE=$ref
exec .venv/bin/python -m pytest tests/image -q -p no:cacheprovider -o tmp_path_retention_policy=failed "$@"
