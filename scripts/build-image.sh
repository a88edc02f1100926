#!/usr/bin/env bash
# Build the cxlkv container image from ./Containerfile with docker (when its
# daemon answers), podman or buildah, installing Debian's podman if none is
# present.
#
#   scripts/build-image.sh              full multi-stage build (pulls RUST_IMAGE)
#   scripts/build-image.sh --prebuilt   from target/release/cxlkv (cargo build
#                                       --release --locked); needs no registry
#   scripts/build-image.sh --push       build, then push the reference
#   scripts/build-image.sh --print-ref  print the image reference and exit
#
# The reference is the `cxlkv` entry of deploy/kubernetes/base/kustomization.yaml
# (`images:`) with the crate version from Cargo.toml as its tag; IMAGE=name[:tag]
# overrides it. ENGINE=docker|podman|buildah picks the engine; RUST_IMAGE the
# build stage's base. The reference is the only thing written to stdout.
set -euo pipefail
cd "$(dirname "$0")/.."

target=runtime push=0
for a in "$@"; do
  case $a in
    --prebuilt) target=prebuilt ;;
    --push) push=1 ;;
    --print-ref) print_only=1 ;;
    *) echo "unknown argument: $a" >&2; exit 2 ;;
  esac
done

name=$(awk '/^images:/ {i = 1; next} i && /- name: cxlkv$/ {c = 1; next} c && /newName:/ {print $2; exit}' \
  deploy/kubernetes/base/kustomization.yaml)
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n1)
[ -n "$name" ] && [ -n "$version" ] || { echo "cannot read the image name or the crate version" >&2; exit 1; }
ref=${IMAGE:-$name:$version}
case ${ref##*/} in *:*) ;; *) ref=$ref:$version ;; esac
if [ "${print_only:-0}" = 1 ]; then echo "$ref"; exit 0; fi
exec 3>&1 1>&2 # progress to stderr

engine=${ENGINE:-}
if [ -z "$engine" ]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then engine=docker
  elif command -v podman >/dev/null; then engine=podman
  elif command -v buildah >/dev/null; then engine=buildah
  else
    echo "== no container engine: installing Debian's podman (and runc)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends podman runc >/dev/null
    engine=podman
  fi
fi

if [ "$target" = prebuilt ]; then
  cargo build --release --locked --bin cxlkv
  bash scripts/image-rootfs.sh target/release/cxlkv target/image-rootfs
fi

echo "== $engine: building $ref (target $target)"
args=(-f Containerfile --target "$target" -t "$ref")
[ -n "${RUST_IMAGE:-}" ] && args+=(--build-arg "RUST_IMAGE=$RUST_IMAGE")
case $engine in
  docker) DOCKER_BUILDKIT=1 docker build "${args[@]}" . ;;
  podman) podman build "${args[@]}" . ;;
  buildah) buildah build "${args[@]}" . ;;
  *) echo "unknown engine: $engine" >&2; exit 2 ;;
esac
if [ "$push" = 1 ]; then "$engine" push "$ref"; fi
echo "$ref" >&3
