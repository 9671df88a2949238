#!/usr/bin/env bash
# Regenerates the fake sysfs trees the probe's tests read (run it from
# anywhere; it rewrites the trees next to it). The layout mirrors a real
# /sys: devices under sys/devices/pci0000:00/, and sys/bus/pci/devices,
# sys/class/drm and sys/class/infiniband as relative symlinks into it.
#
#   amd4               4 AMD Instinct MI210 (amdgpu bound, DRM cards, KFD
#                      topology with a CPU node; the KFD order deliberately
#                      differs from the PCI order), an AMD audio function
#                      and a host bridge that are not GPUs
#   nvidia-nodriver    2 NVIDIA H100 PCI functions with no driver bound and
#                      an NVSwitch bridge function that is not a GPU
#   ib                 2 ConnectX ports as InfiniBand: mlx5_0 ACTIVE (with
#                      IPoIB ib0), mlx5_1 DOWN
#   roce               1 ConnectX port as Ethernet (RoCE v1 and v2 GIDs on
#                      ens1f0np0)
#   bare               a host bridge and nothing else
set -euo pipefail
cd "$(dirname "$0")"

w() { # w FILE CONTENT...: write a file, creating its directory
	mkdir -p "$(dirname "$1")"
	local f=$1
	shift
	printf '%s\n' "$@" >"$f"
}
l() { # l TARGET LINK: a relative symlink
	mkdir -p "$(dirname "$2")"
	ln -sfn "$1" "$2"
}

pcidev() { # pcidev TREE ADDR VENDOR DEVICE CLASS [DRIVER]
	local t=$1 a=$2 d=$1/sys/devices/pci0000:00/$2
	w "$d/vendor" "$3"
	w "$d/device" "$4"
	w "$d/class" "$5"
	if [ -n "${6:-}" ]; then
		w "$d/uevent" "DRIVER=$6" "PCI_CLASS=${5#0x}" "PCI_SLOT_NAME=$a"
		mkdir -p "$t/sys/bus/pci/drivers/$6"
		l "../../../bus/pci/drivers/$6" "$d/driver"
	else
		w "$d/uevent" "PCI_CLASS=${5#0x}" "PCI_SLOT_NAME=$a"
	fi
	l "../../../devices/pci0000:00/$a" "$t/sys/bus/pci/devices/$a"
}

rm -rf amd4 nvidia-nodriver ib roce bare

# --- amd4 ------------------------------------------------------------------
t=amd4
pcidev $t 0000:00:00.0 0x1022 0x14d8 0x060000
w $t/sys/class/drm/version "drm 1.1.0 20060810"
addrs=(0000:03:00.0 0000:23:00.0 0000:43:00.0 0000:63:00.0)
uids=(6ea6b16ce1e5a001 6ea6b16ce1e5a002 6ea6b16ce1e5a003 6ea6b16ce1e5a004)
for i in 0 1 2 3; do
	a=${addrs[$i]}
	d=$t/sys/devices/pci0000:00/$a
	pcidev $t "$a" 0x1002 0x740f 0x038000 amdgpu
	w "$d/mem_info_vram_total" 68702699520
	w "$d/product_name" "AMD Instinct MI210"
	w "$d/unique_id" "${uids[$i]}"
	mkdir -p "$d/drm/card$i" "$d/drm/renderD$((128 + i))"
	l "../../../$a" "$d/drm/card$i/device"
	l "../../../$a" "$d/drm/renderD$((128 + i))/device"
	l "../../devices/pci0000:00/$a/drm/card$i" "$t/sys/class/drm/card$i"
	l "../../devices/pci0000:00/$a/drm/renderD$((128 + i))" "$t/sys/class/drm/renderD$((128 + i))"
done
pcidev $t 0000:03:00.1 0x1002 0xab28 0x040300 snd_hda_intel
k=$t/sys/class/kfd/kfd/topology/nodes
w $k/0/properties "cpu_cores_count 64" "simd_count 0" "mem_banks_count 1" "gfx_target_version 0" \
	"vendor_id 0" "device_id 0" "location_id 0" "domain 0" "drm_render_minor 0" "unique_id 0"
w $k/0/name ""
# KFD node n -> card: 1 -> card1 (23), 2 -> card0 (03), 3 -> card2 (43),
# 4 -> card3 (63). unique_id is the card's, in decimal.
kfd_card=(1 0 2 3)
for n in 1 2 3 4; do
	c=${kfd_card[$((n - 1))]}
	bus=$((16#${addrs[$c]:5:2}))
	w $k/$n/properties "cpu_cores_count 0" "simd_count 416" "mem_banks_count 1" \
		"gfx_target_version 90010" "vendor_id 4098" "device_id 29711" \
		"location_id $((bus << 8))" "domain 0" "drm_render_minor $((128 + n))" \
		"unique_id $((16#${uids[$c]}))" "num_xcc 1"
	w $k/$n/name gfx90a
done

# --- nvidia-nodriver -------------------------------------------------------
t=nvidia-nodriver
pcidev $t 0000:00:00.0 0x8086 0x09a2 0x060000
pcidev $t 0000:3b:00.0 0x10de 0x2330 0x030200
pcidev $t 0000:86:00.0 0x10de 0x2330 0x030200
pcidev $t 0000:05:00.0 0x10de 0x22a3 0x068000

# --- ib and roce -----------------------------------------------------------
zero=0000:0000:0000:0000:0000:0000:0000:0000
ibdev() { # ibdev TREE PCIADDR NAME GUID LINKLAYER STATE PHYS RATE NETDEV
	local t=$1 a=$2 n=$3 d=$1/sys/devices/pci0000:00/$2
	pcidev "$t" "$a" 0x15b3 0x101b "$([ "$5" = InfiniBand ] && echo 0x020700 || echo 0x020000)" mlx5_core
	local i=$d/infiniband/$n
	w "$i/node_guid" "$4"
	w "$i/node_type" "1: CA"
	w "$i/fw_ver" "20.39.1002"
	l "../../../$a" "$i/device"
	l "../../devices/pci0000:00/$a/infiniband/$n" "$t/sys/class/infiniband/$n"
	local p=$i/ports/1
	w "$p/link_layer" "$5"
	w "$p/state" "$6"
	w "$p/phys_state" "$7"
	w "$p/rate" "$8"
	w "$d/net/$9/dev_port" 0
	w "$d/net/$9/address" "00:00:00:00:00:00"
}

t=ib
pcidev $t 0000:00:00.0 0x8086 0x09a2 0x060000
ibdev $t 0000:17:00.0 mlx5_0 0c42:a103:0065:1234 InfiniBand "4: ACTIVE" "5: LinkUp" "200 Gb/sec (4X HDR)" ib0
p=$t/sys/devices/pci0000:00/0000:17:00.0/infiniband/mlx5_0/ports/1
w $p/lid 0x12
w $p/gids/0 fe80:0000:0000:0000:0c42:a103:0065:1234
w $p/gids/1 $zero
w $p/gid_attrs/types/0 "IB/RoCE v1"
ibdev $t 0000:18:00.0 mlx5_1 0c42:a103:0065:1235 InfiniBand "1: DOWN" "3: Disabled" "10 Gb/sec (4X SDR)" ib1
p=$t/sys/devices/pci0000:00/0000:18:00.0/infiniband/mlx5_1/ports/1
w $p/lid 0xffff
w $p/gids/0 fe80:0000:0000:0000:0c42:a103:0065:1235
w $p/gid_attrs/types/0 "IB/RoCE v1"

t=roce
pcidev $t 0000:00:00.0 0x8086 0x09a2 0x060000
ibdev $t 0000:31:00.0 mlx5_0 0c42:a103:00f2:0a10 Ethernet "4: ACTIVE" "5: LinkUp" "100 Gb/sec (4X EDR)" ens1f0np0
p=$t/sys/devices/pci0000:00/0000:31:00.0/infiniband/mlx5_0/ports/1
w $p/lid 0x0
gids=(fe80:0000:0000:0000:0e42:a1ff:fef2:0a10 fe80:0000:0000:0000:0e42:a1ff:fef2:0a10
	0000:0000:0000:0000:0000:ffff:0a00:0005 0000:0000:0000:0000:0000:ffff:0a00:0005 $zero $zero)
types=("IB/RoCE v1" "RoCE v2" "IB/RoCE v1" "RoCE v2")
for g in 0 1 2 3 4 5; do
	w $p/gids/$g "${gids[$g]}"
	if [ $g -lt 4 ]; then
		w $p/gid_attrs/types/$g "${types[$g]}"
		w $p/gid_attrs/ndevs/$g ens1f0np0
	fi
done

# --- bare ------------------------------------------------------------------
t=bare
pcidev $t 0000:00:00.0 0x8086 0x09a2 0x060000
