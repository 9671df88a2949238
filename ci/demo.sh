#!/usr/bin/env bash
# The main job for now: the control plane and the bridge end to end on the
# embedded store. Four simulated ranks (2 NVIDIA + 2 AMD) probe their node,
# discover each other through a c10d-compatible store and print the topology
# they agree on; then the two island leaders run a bridged all_reduce of real
# data through gbbridge, verified element by element, and print its bandwidth.
set -euo pipefail
bin=${1:-$(dirname "$0")/../bin}
export PATH="$bin:$PATH"
command -v jq >/dev/null 2>&1 && have_jq=1 || have_jq=0

work=$(mktemp -d)
cleanup() {
  [ -n "${store_pid:-}" ] && kill "$store_pid" 2>/dev/null && wait "$store_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

# The embedded store on a free port; it prints {"listen": ...} once ready.
gbdiscover serve --listen 127.0.0.1:0 > "$work/serve.json" 2> "$work/serve.log" &
store_pid=$!
for _ in $(seq 100); do [ -s "$work/serve.json" ] && break; sleep 0.05; done
addr=$(sed -n 's/.*"listen":"\([^"]*\)".*/\1/p' "$work/serve.json")
[ -n "$addr" ] || { echo "demo: the store did not start:"; cat "$work/serve.log"; exit 2; } >&2
echo "demo: embedded c10d store on $addr" >&2

vendors=(nvidia nvidia amd amd)
pids=()
for r in 0 1 2 3; do
  ( GPUBRIDGE_VENDOR=${vendors[$r]} gbprobe --json \
    | gbdiscover --store "$addr" --rank "$r" --world-size 4 --namespace demo --local-rank "$r" --timeout 30s \
    > "$work/topo.$r.json" 2> "$work/rank.$r.log" ) &
  pids+=($!)
done
fail=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { echo "demo: rank $i failed:" >&2; cat "$work/rank.$i.log" >&2; fail=1; }
done
[ "$fail" -eq 0 ] || exit 1

digests=$(for r in 0 1 2 3; do sed -n 's/^  "digest": "\(.*\)",$/\1/p' "$work/topo.$r.json"; done | sort -u)
[ "$(echo "$digests" | wc -l)" -eq 1 ] || { echo "demo: ranks disagree on the topology: $digests" >&2; exit 1; }

echo "rank 0's topology (every rank agrees, digest $digests):" >&2
cat "$work/topo.0.json"
if [ "$have_jq" -eq 1 ]; then
  jq -r '.islands[] | "island \(.label): ranks \(.ranks) leader \(.leader) backend \(.backend)"' "$work/topo.0.json" >&2
  jq -r '"bridge: members \(.bridge.members) transport \(.bridge.transport) (\(.bridge.reason))"' "$work/topo.0.json" >&2
fi
echo "demo: 4 ranks agree on the topology" >&2

# The bridge: each leader joins as its member index among bridge.members,
# over the transport discovery chose.
read -r transport m0 m1 < <(python3 -c 'import json,sys
t = json.load(open(sys.argv[1]))
print(t["bridge"]["transport"], *t["bridge"]["members"])' "$work/topo.0.json")
echo "demo: leaders (ranks $m0 and $m1) all-reduce float32 buffers over the $transport bridge:" >&2
for i in 0 1; do
  gbbridge bench --store "$addr" --rank "$i" --world-size 2 --namespace demo-bridge --transport "$transport" \
    --collective all_reduce --sizes 4K,1M,64M --iters 3 --timeout 60s > "$work/bridge.$i.txt" 2> "$work/bridge.$i.log" &
  pids[$i]=$!
done
for i in 0 1; do
  wait "${pids[$i]}" || { echo "demo: bridge member $i failed:" >&2; cat "$work/bridge.$i.log" >&2; exit 1; }
done
cat "$work/bridge.0.txt"
wrong=$(awk '!/^#/ {s += $8} END {print s+0}' "$work/bridge.0.txt")
[ "$wrong" -eq 0 ] || { echo "demo: $wrong wrong elements" >&2; exit 1; }
echo "demo: every element of every all_reduce equals the exact sum over both leaders (#wrong 0)" >&2
