#!/usr/bin/env bash
# The soft-RoCE lane: two QEMU guests (TCG; Debian's kernel, whose rdma_rxe
# gives libibverbs a real RoCE v2 device) joined by a virtual Ethernet link,
# one rxe device on each end. Inside them: gbprobe, the verbs Go tests, the
# bridge selftest on one host and across the two, a bit-exact all_reduce
# and the plugin's feed path across them, verbs vs tcp bench rows, and the
# fault checks (a member killed mid-collective, the link taken down
# mid-transfer; a forged ring key is one of the Go tests).
#
#   ci/vm/run.sh [OUT_DIR]      (make vm-test; OUT_DIR default out/test)
#
# Results come back through a 9p share per guest: each step's stdout,
# stderr, exit status and seconds. The Go tests' output becomes go test
# -json streams OUT_DIR/vm-*.json for ci/testreport. Exit 0 when every step
# did what it should, 1 otherwise (with the failed steps' output and the
# consoles' tails), 2 when the lane could not run.
#
# Why two guests and not two network namespaces in one (the issue's first
# idea): this kernel's rdma_rxe (6.1) routes and listens in the initial
# network namespace only, so an rxe device on a veth end moved into another
# namespace gets "local QP operation error" on its first send (tried); two
# guests are two hosts, each with its own stack.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${1:-$ROOT/out/test}
GO=${GO:-go}
# TCG is 10-50x slower than the host: deadlines stretch further inside.
SCALE=$((3 * ${GPUBRIDGE_TEST_TIMEOUT_SCALE:-1}))
LIMIT=${GPUBRIDGE_VM_LIMIT:-900} # seconds for the guests, a hang guard
mkdir -p "$OUT"
W=$(mktemp -d /tmp/gpubridge-vm.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$W"
}
trap cleanup EXIT

K=""
for v in $(ls /lib/modules | sort -rV); do
  if [ -r "/boot/vmlinuz-$v" ] && modinfo -k "$v" -n rdma_rxe >/dev/null 2>&1; then K=$v; break; fi
done
if [ -z "$K" ]; then
  echo "vm: no readable /boot/vmlinuz-* with an rdma_rxe module (install linux-image-amd64: ci/vm/deps.sh)" >&2
  exit 2
fi

echo "vm: building (kernel $K, timeouts x$SCALE)" >&2
mkdir -p "$W/bin" "$W/out-a" "$W/out-b"
(cd "$ROOT" && CGO_ENABLED=1 $GO build -trimpath -o "$W/bin/" ./tools/gbprobe ./tools/gbbridge ./tools/gbdiscover ./ci/vm/vmcheck)
(cd "$ROOT" && CGO_ENABLED=1 $GO test -c -o "$W/bin/transport.test" ./lib/transport)
(cd "$ROOT" && CGO_ENABLED=1 $GO test -c -o "$W/bin/ibverbs.test" ./lib/ibverbs)
"$ROOT/ci/vm/initrd.sh" "$K" "$W/bin" "$W/initrd.cpio.gz"
echo "vm: initramfs $(du -h "$W/initrd.cpio.gz" | cut -f1)" >&2

boot() { # boot ROLE PEER MAC SMP MEM
  timeout "$LIMIT" qemu-system-x86_64 -accel tcg -m "$5" -smp "$4" -nographic -no-reboot \
    -kernel "/boot/vmlinuz-$K" -initrd "$W/initrd.cpio.gz" \
    -append "console=ttyS0 quiet panic=-1 gb.role=$1 gb.scale=$SCALE" \
    -netdev "dgram,id=n0,local.type=unix,local.path=$W/$1.sock,remote.type=unix,remote.path=$W/$2.sock" \
    -device "virtio-net-pci,netdev=n0,mac=$3,host_mtu=9000" \
    -virtfs "local,path=$W/out-$1,mount_tag=out,security_model=none,id=out" \
    > "$W/console-$1.log" 2>&1 < /dev/null
  echo $? > "$W/qemu-$1.rc"
}
t0=$(date +%s)
boot a b 52:54:00:00:00:01 2 3072 & pids+=($!)
boot b a 52:54:00:00:00:02 1 1024 & pids+=($!)
wait "${pids[@]}" || true
pids=()
echo "vm: guests ran $(( $(date +%s) - t0 ))s" >&2

# What each step must end with: 0, except member 1 of the kill check, which
# is SIGKILLed (137).
want() { [ "$1/$2" = b/x-kill ] && echo 137 || echo 0; }
steps_a="x-selftest x-allreduce x-feed x-bench-verbs x-bench-tcp x-kill x-linkdown probe probe-check go-ibverbs go-transport selftest"
steps_b="x-selftest x-allreduce x-feed x-bench-verbs x-bench-tcp x-kill x-linkdown"
failed=0
printf '%-6s %-15s %4s %8s\n' guest step rc seconds
for role in a b; do
  eval "steps=\$steps_$role"
  for s in $steps; do
    d=$W/out-$role
    rc=$(cat "$d/$s.rc" 2>/dev/null || echo missing)
    printf '%-6s %-15s %4s %8s\n' "$role" "$s" "$rc" "$(cat "$d/$s.sec" 2>/dev/null || echo -)"
    if [ "$rc" != "$(want $role $s)" ]; then
      failed=1
      echo "vm: step $s in guest $role ended with $rc, want $(want $role $s)"
      echo "---- stderr (tail):"; tail -n 40 "$d/$s.err" 2>/dev/null || true
      echo "---- stdout (tail):"; tail -n 20 "$d/$s.out" 2>/dev/null || true
      echo "----"
    fi
  done
done

# The Go tests as go test -json streams, for the skip list.
for t in ibverbs transport; do
  if [ -s "$W/out-a/go-$t.out" ]; then
    (cd "$ROOT" && $GO tool test2json -t -p "github.com/gpubridge/gpubridge/lib/$t" < "$W/out-a/go-$t.out") > "$OUT/vm-$t.json" || true
  fi
done
# The raw results stay for reading.
rm -rf "$OUT/vm"
mkdir -p "$OUT/vm"
cp -r "$W/out-a" "$W/out-b" "$W"/console-*.log "$OUT/vm/" 2>/dev/null || true

echo "vm: verbs vs tcp between the two guests (a sanity check, not a performance figure: soft-RoCE under TCG):"
for tr in verbs tcp; do
  grep -h '"schema"' "$W/out-a/x-bench-$tr.out" 2>/dev/null | sed -n 's/.*"size":\([0-9]*\).*"algbw_gbps":\([0-9.e+-]*\).*/  '"$tr"' \1 bytes: \2 GB\/s/p' || true
done
grep -h '^selftest: ' "$W/out-a/selftest.err" "$W/out-a/x-selftest.err" 2>/dev/null | tail -n 4 || true

for role in a b; do
  if ! grep -q "gb-vm: done" "$W/console-$role.log"; then
    failed=1
    echo "vm: guest $role did not finish (qemu exit $(cat "$W/qemu-$role.rc" 2>/dev/null || echo ?)); its console's tail:"
    tail -n 40 "$W/console-$role.log"
  fi
done
if [ "$failed" -ne 0 ]; then
  echo "vm: FAILED (everything is under $OUT/vm)"
  exit 1
fi
echo "vm: all steps passed ($(( $(date +%s) - t0 ))s in the guests)"
