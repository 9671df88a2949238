#!/usr/bin/env bash
# Builds the guest's initramfs from this Debian system's packages:
# busybox, the kernel modules rdma_rxe, virtio-net and 9p need (in the
# order modprobe --show-depends gives), iproute2's ip, rdma-core's rdma and
# ibv_devinfo, libibverbs with the rxe provider, every library ldd names,
# gpubridge's binaries from BINDIR, and the guest's init.
#
#   ci/vm/initrd.sh KERNEL_VERSION BINDIR OUT.cpio.gz
set -euo pipefail
K=$1 BINDIR=$2 OUT=$3
HERE=$(cd "$(dirname "$0")" && pwd)
R=$(mktemp -d)
trap 'rm -rf "$R"' EXIT
mkdir -p "$R"/{bin,sbin,usr/bin,usr/sbin,lib/modules,etc/libibverbs.d,gb/bin,out,tmp,proc,sys,dev,run}
cp /bin/busybox "$R/bin/busybox"
ln -s busybox "$R/bin/sh"
: > "$R/modules.order"
for m in crc32_generic rdma_rxe virtio_pci virtio_net 9pnet_virtio 9p; do
  modprobe --show-depends -S "$K" "$m"
done | awk '$1 == "insmod" && !seen[$2]++ { print $2 }' | while read -r ko; do
  cp "$ko" "$R/lib/modules/"
  echo "/lib/modules/$(basename "$ko")" >> "$R/modules.order"
done
BINS="/usr/bin/ibv_devinfo /usr/bin/ibv_devices /usr/bin/rdma /usr/sbin/ip"
for b in $BINS; do cp -L "$b" "$R$b"; done
MA=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo x86_64-linux-gnu)
PROV=/usr/lib/$MA/libibverbs/librxe-rdmav34.so
[ -e "$PROV" ] || PROV=$(ls /usr/lib/"$MA"/libibverbs/librxe-rdmav*.so | head -1)
mkdir -p "$R$(dirname "$PROV")"
cp -L "$PROV" "$R$PROV"
cp /etc/libibverbs.d/rxe.driver "$R/etc/libibverbs.d/"
cp "$BINDIR"/* "$R/gb/bin/"
# libibverbs is dlopened by gpubridge: ldd of the binaries does not name it.
LIBV=$(ls /usr/lib/"$MA"/libibverbs.so.1* | head -1)
for f in $BINS "$PROV" "$LIBV" "$R"/gb/bin/*; do
  ldd "$f" 2>/dev/null | grep -o '/[^ ]*' || true
done | sort -u | while read -r l; do
  mkdir -p "$R$(dirname "$l")"
  cp -L "$l" "$R$l"
done
cp -L "$LIBV" "$R/usr/lib/$MA/libibverbs.so.1"
cp -L /lib/"$MA"/libgcc_s.so.1 "$R/lib/$MA/" # pthread_exit needs it
cp "${GB_VM_INIT:-$HERE/init}" "$R/init"
chmod +x "$R/init"
(cd "$R" && find . | cpio -o -H newc --quiet | gzip -1) > "$OUT"
