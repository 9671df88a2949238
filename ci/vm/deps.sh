#!/usr/bin/env bash
# What the soft-RoCE VM lane (ci/vm/run.sh) needs of Debian 12: QEMU, a
# Debian kernel with rdma_rxe and its modules, busybox, rdma-core's tools
# and libibverbs with the rxe provider. As root it installs what is
# missing; as another user it names the packages and exits 3 (the lane is
# then listed as skipped).
set -euo pipefail
pkgs=(qemu-system-x86 linux-image-amd64 busybox-static rdma-core ibverbs-providers ibverbs-utils libibverbs-dev cpio kmod iproute2)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "vm deps: missing Debian packages: ${missing[*]}" >&2
    exit 3
  fi
  echo "vm deps: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi
