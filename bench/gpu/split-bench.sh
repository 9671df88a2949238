#!/usr/bin/env bash
# The 2-member TCP all_reduce's algorithms by size (issue 12), ~5 minutes on
# a 16-core host, from the repository root: bash bench/gpu/split-bench.sh
#
# gbbridge bench, members as processes on this host, 8 TCP streams: the
# exchange ceiling, the all_reduce exchanging at every size (--split off)
# and splitting at every size (--split 1M: the ring of two), one core's
# memcpy; the 4-member ring; with GB_BEFORE=PATH (another gbbridge binary)
# the 2- and 4-member all_reduce of that binary too (--split off where it
# has it); torch Gloo of 2 and 4 ranks. GB_PASSES (2) passes alternate the
# configurations. Every row is checked element by element; rows carry
# "config" and "pass". Writes $OUT/rows.jsonl (default /tmp/gpubridge-out)
# and prints the mean algbw per size and configuration.
#
# Rows of the one-off script this one replays: docs/bench/h200x1-split-c318405.jsonl
# (its "before" configurations are named -8613b69: that commit's binary),
# docs/bench/devbox-split-c318405.jsonl.
set -uo pipefail
out=${OUT:-/tmp/gpubridge-out}; mkdir -p "$out"
PY=${PYTHON:-python3}
rows=$out/rows.jsonl; : > "$rows"
sizes=${GB_SIZES:-1M,2M,4M,8M,16M,64M,256M,1G}
sizes4=${GB_SIZES_4:-4M,16M,64M,256M,1G}
before=${GB_BEFORE:-}
[ -x bin/gbbridge ] || { echo "bin/gbbridge is missing: build with 'make build' and carry bin/"; exit 2; }
t0=$(date +%s)
failed=0
b() {  # b CONFIG PASS BINARY ARGS...
  local cfg=$1 pass=$2 exe=$3; shift 3
  timeout -k 5 "${GB_LIMIT_S:-120}" "$exe" bench --json --iters 3 --warmup 1 --min-time 0.2s "$@" 2>>"$out/split-bench.err" \
    | "$PY" bench/tag_rows.py "$cfg" | sed "s/^{/{\"pass\":$pass,/" >> "$rows"
  local rc=${PIPESTATUS[0]}
  echo "== $cfg pass $pass rc $rc $(( $(date +%s) - t0 ))s" >&2
  (( rc == 0 )) || failed=1
}
two=(--members 2 --transport tcp --streams 8 --sizes "$sizes")
four=(--members 4 --transport tcp --streams 8 --sizes "$sizes4")
for pass in $(seq "${GB_PASSES:-2}"); do
  b memcpy "$pass" bin/gbbridge --members 2 --transport shm --streams 8 --sizes "$sizes" --collective memcpy
  b tcp-exchange-s8 "$pass" bin/gbbridge "${two[@]}" --collective exchange
  b tcp-allreduce-s8-nosplit "$pass" bin/gbbridge "${two[@]}" --split off
  b tcp-allreduce-s8-split1m "$pass" bin/gbbridge "${two[@]}" --split 1M
  if [ -n "$before" ]; then
    split=(); "$before" bench --help 2>&1 | grep -q -- --split && split=(--split off)
    b tcp-allreduce-s8-before "$pass" "$before" "${two[@]}" "${split[@]}"
  fi
  b tcp-allreduce-4m-s8 "$pass" bin/gbbridge "${four[@]}"
  [ -n "$before" ] && b tcp-allreduce-4m-s8-before "$pass" "$before" "${four[@]}"
done
for n in 2 4; do
  timeout 200 "$PY" bench/gloo_allreduce.py --members "$n" --sizes "$sizes4" --iters 3 --min-time 0.2 | "$PY" bench/tag_rows.py "gloo-$n" >> "$rows"
  echo "== gloo-$n rc ${PIPESTATUS[0]} $(( $(date +%s) - t0 ))s" >&2
done
"$PY" - "$rows" <<'PY'
import collections, json, sys
d = collections.defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    d[(r["size"], r["config"])].append(r["algbw_gbps"])
    if r.get("wrong"):
        print("WRONG:", r["config"], r["size"], r["wrong"])
for (size, cfg), v in sorted(d.items()):
    print(f"{size >> 20:>6} MiB  {cfg:<28} {sum(v) / len(v):7.2f} GB/s  ({', '.join(f'{x:.2f}' for x in v)})")
PY
exit "$failed"
