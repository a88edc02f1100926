#!/usr/bin/env bash
# Lay out the container image's root filesystem in OUT: the cxlkv binary, the
# shared libraries it links (found with ldd), the default config and the
# directories the manifests mount. The Containerfile's build stage runs this
# on the binary it compiles; scripts/build-image.sh --prebuilt runs it on
# target/release/cxlkv. Both images therefore have the same layout.
#
# usage: scripts/image-rootfs.sh BIN OUT
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 BIN OUT" >&2; exit 2; }
bin=$1 out=$2
here="$(cd "$(dirname "$0")/.." && pwd)"
uid=65532 # the Containerfile's USER; tests/system/test_deploy.py checks they agree

rm -rf "$out"
mkdir -p "$out/usr/local/bin" "$out/etc/cxlkv" "$out/run/cxlkv" "$out/tmp"
chmod 1777 "$out/tmp"
install -m 0755 "$bin" "$out/usr/local/bin/cxlkv"
# Line tables stay in target/release for debugging; the image needs none.
if command -v objcopy >/dev/null; then objcopy --strip-debug "$out/usr/local/bin/cxlkv"; fi

# Every shared object the dynamic linker loads, at the path it loads it from
# (the interpreter included); symlinks are resolved into plain files.
libs=$(ldd "$bin" | awk '
  /not found/ { print "MISSING " $1; next }
  $2 == "=>" && $3 ~ /^\// { print $3; next }
  $1 ~ /^\// { print $1 }')
if grep -q MISSING <<<"$libs"; then echo "unresolved libraries: $libs" >&2; exit 1; fi
for lib in $libs; do
  mkdir -p "$out$(dirname "$lib")"
  cp -L "$lib" "$out$lib"
done

# The shipped Kubernetes config is the default; the manifests mount a
# ConfigMap over /etc/cxlkv.
install -m 0644 "$here/deploy/kubernetes/base/cxlkv.toml" "$out/etc/cxlkv/cxlkv.toml"
printf 'root:x:0:0:root:/root:/sbin/nologin\ncxlkv:x:%d:%d:cxlkv:/nonexistent:/sbin/nologin\n' $uid $uid >"$out/etc/passwd"
printf 'root:x:0:\ncxlkv:x:%d:\n' $uid >"$out/etc/group"
printf 'hosts: files dns\n' >"$out/etc/nsswitch.conf"
