#!/usr/bin/env bash
# Compression on the bridge (issue 13 phase 2), in one run on one machine:
#   - lib/codec's kernels per core (fp8 and bf16 encode, decode,
#     decode-add, encode-feedback of float32; memcpy as their anchor),
#     go test -bench -count GB_KCOUNT (medians in the table);
#   - gbbridge bench, 2 members over TCP, all_reduce float32 sum of random
#     values with --codec raw, bf16, fp8, fp8 --feedback and zstd (and fp8
#     with 512 KiB chunks), beside the raw exchange (the ceiling) and
#     memcpy anchors, GB_REPS rounds:
#     over loopback, and between two network namespaces joined by veth
#     pairs and a bridge, each uplink limited to GB_RATE with tc htb (needs
#     root, ip and tc; skipped otherwise).
# Usage: bench/codec_bridge.sh OUTDIR [BIN]
# Writes OUTDIR/rows.jsonl: the kernels' rows (gpubridge.codec-bench/v1)
# and the bench rows (gpubridge.bench/v1) with "link", "round", "config"
# (the configuration's name below), "commit" and the load average after
# the configuration ran. GB_SIZES (64M,256M), GB_ITERS
# (3), GB_REPS (3), GB_RATE (1gbit), GB_KCOUNT (5).
set -euo pipefail
out=${1:?usage: bench/codec_bridge.sh OUTDIR [BIN]}
bin=${2:-bin}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
commit=$(git -C "$here" rev-parse --short HEAD)
sizes=${GB_SIZES:-64M,256M}
iters=${GB_ITERS:-3}
reps=${GB_REPS:-3}
rate=${GB_RATE:-1gbit}
rows=$out/rows.jsonl
: > "$rows"

# The kernels: rows as bench/codec.sh makes them (no dumps, no stat).
cat /proc/loadavg > "$out/load-before"
(cd "$here/.." && go test -run '^$' -bench 'BenchmarkMXFP8|BenchmarkBF16' -benchtime 1s -count "${GB_KCOUNT:-5}" ./lib/codec) | tee "$out/bench.txt" >&2
cat /proc/loadavg > "$out/load-after"
: > "$out/stat.jsonl"
python3 "$here/codec_rows.py" "$out" "$commit" >> "$rows"

tag() { # tag LINK ROUND CONFIG: add the run's fields to each JSON row on stdin
  python3 -c 'import json,sys
load = open("/proc/loadavg").read().split()[0]
for l in sys.stdin:
    if l.startswith("{"):
        d = json.loads(l)
        d.update(link=sys.argv[1], round=int(sys.argv[2]), config=sys.argv[3], commit=sys.argv[4], load=float(load))
        print(json.dumps(d), flush=True)' "$1" "$2" "$3" "$commit"
}

# The configurations each round times: name, then gbbridge bench's flags.
configs=(
  "memcpy --collective memcpy"
  "exchange --collective exchange"
  "raw --codec raw"
  "bf16 --codec bf16"
  "fp8 --codec fp8"
  "fp8-feedback --codec fp8 --feedback"
  "zstd --codec zstd"
  "fp8-chunk512K --codec fp8 --chunk 512K"
)
# Loopback only: memcpy has no link; the 512 KiB chunks (packed fp8 frames
# of 132 KiB, which stay in a core's cache between their read and their
# decoding) show what a decoder fed in pieces could gain over frames read
# whole (1.03 MiB at the default 4 MiB chunk).
loopback_only="memcpy fp8-chunk512K"

loopback() { # loopback ROUND
  for c in "${configs[@]}"; do
    read -r name flags <<< "$c"
    echo "== loopback round $1: $name" >&2
    # shellcheck disable=SC2086
    "$bin/gbbridge" bench --json --members 2 --transport tcp --data random --sizes "$sizes" --iters "$iters" --warmup 1 $flags \
      | tag loopback "$1" "$name" >> "$rows"
  done
}

ns=gbc$$
netns_up() {
  ip netns add "$ns-sw"
  ip -n "$ns-sw" link add br0 type bridge
  ip -n "$ns-sw" link set br0 up
  for i in 0 1; do
    ip netns add "$ns-h$i"
    ip link add eth0 netns "$ns-h$i" type veth peer name "p$i" netns "$ns-sw"
    ip -n "$ns-sw" link set "p$i" master br0 up
    ip -n "$ns-h$i" addr add "10.232.$(( $$ % 200 )).$((i + 1))/24" dev eth0
    ip -n "$ns-h$i" link set eth0 up
    ip -n "$ns-h$i" link set lo up
    ip netns exec "$ns-h$i" tc qdisc add dev eth0 root handle 1: htb default 10
    ip netns exec "$ns-h$i" tc class add dev eth0 parent 1: classid 1:10 htb rate "$rate"
  done
}
netns_down() {
  for n in "$ns-h0" "$ns-h1" "$ns-sw"; do ip netns del "$n" 2>/dev/null || true; done
}

limited() { # limited ROUND STORE
  local link="htb $rate"
  for c in "${configs[@]}"; do
    read -r name flags <<< "$c"
    [[ " $loopback_only " == *" $name "* ]] && continue
    echo "== $link round $1: $name" >&2
    local pids=()
    for i in 1 0; do
      # shellcheck disable=SC2086
      GPUBRIDGE_SIM_HOSTNAME=host-$i ip netns exec "$ns-h$i" "$bin/gbbridge" bench --json --store "$2" --rank $i --world-size 2 \
        --namespace "codec-$1-$name" --transport tcp --timeout 300s --data random --sizes "$sizes" --iters "$iters" --warmup 1 $flags \
        > "$out/member$i.jsonl" &
      pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
    tag "$link" "$1" "$name" < "$out/member0.jsonl" >> "$rows"
  done
}

netns=0
if [ "$(id -u)" = 0 ] && command -v tc > /dev/null; then
  netns=1
  trap 'kill "${store_pid:-}" 2>/dev/null || true; netns_down' EXIT
  netns_up
  ip netns exec "$ns-h0" "$bin/gbdiscover" serve --listen "10.232.$(( $$ % 200 )).1:0" > "$out/store.json" &
  store_pid=$!
  for _ in $(seq 50); do [ -s "$out/store.json" ] && break; sleep 0.1; done
  store=$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["listen"])' "$out/store.json")
else
  echo "not root or no tc: the rate-limited link is skipped" >&2
fi

for r in $(seq "$reps"); do
  loopback "$r"
  if [ "$netns" = 1 ]; then limited "$r" "$store"; fi
done
echo "rows: $rows" >&2
