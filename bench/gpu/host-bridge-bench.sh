#!/usr/bin/env bash
# The bridge's host data plane on a GPU host's CPUs (issue 12), ~3 minutes,
# from the repository root: bash bench/gpu/host-bridge-bench.sh
#
# gbbridge bench, members as processes on this host: the 2-member all_reduce
# over TCP and shm (8 streams) beside their exchange ceilings (the same
# streams moving the same bytes, nothing reduced), the 4-member all_reduce,
# the TCP all_reduce again exchanging at every size (--split off), the shm
# all_reduces again with the members copying the owners' results
# (--peer-writes off), one core's memcpy, and torch Gloo's all_reduce of 2 and 4 ranks (the anchor),
# 1 MiB .. 1 GiB, every row checked element by element after timing; each
# gbbridge row names the algorithm that ran (exchange, ring, direct-write,
# or direct where the members copy the results: --peer-writes off). Then
# bench/report.py's tables.
#
# Needs bin/gbbridge built on the dev machine and carried, python3 with torch
# (for Gloo). Writes under $OUT (default /tmp/gpubridge-out): rows.jsonl,
# report.md, host-bridge-bench.log. GB_SIZES (default 1M,16M,64M,256M,1G) and
# GB_ITERS (3) and GB_MIN_TIME (0.2 s: more timed calls where calls are
# short) as for bench/run.sh; GB_LIMIT_S bounds each command (120).
set -uo pipefail
out=${OUT:-/tmp/gpubridge-out}; mkdir -p "$out"
exec > >(tee "$out/host-bridge-bench.log") 2>&1
PY=${PYTHON:-python3}
GB_COMMIT=${GB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
echo "== $(date -u +%FT%TZ) host-bridge-bench: commit $GB_COMMIT; $(nproc --all) cores; $(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)"
[ -x bin/gbbridge ] || { echo "bin/gbbridge is missing: build with 'make build' and carry bin/"; exit 2; }
rows=$out/rows.jsonl; : > "$rows"
sizes=${GB_SIZES:-1M,16M,64M,256M,1G}
iters=${GB_ITERS:-3}
mintime=${GB_MIN_TIME:-0.2}
limit=${GB_LIMIT_S:-120}
failed=0
tag() { "$PY" bench/tag_rows.py "$1"; }  # rows of stdin, "config" set
b() {  # b CONFIG ARGS...
  local cfg=$1; shift
  local s=$(date +%s)
  timeout -k 5 "$limit" bin/gbbridge bench --json --iters "$iters" --warmup 1 --min-time "${mintime}s" --sizes "$sizes" "$@" 2>"$out/$cfg.err" | tag "$cfg" >> "$rows"
  local rc=${PIPESTATUS[0]}
  echo "== $cfg: rc=$rc in $(( $(date +%s) - s ))s"
  (( rc == 0 )) || { failed=1; tail -5 "$out/$cfg.err"; }
}
b memcpy --members 2 --transport shm --streams 8 --collective memcpy
b tcp-exchange-s8 --members 2 --transport tcp --streams 8 --collective exchange
b tcp-allreduce-s8 --members 2 --transport tcp --streams 8
# The same exchanging at every size (--split off: before the ring of two),
# for a before/after in one run.
b tcp-allreduce-s8-nosplit --members 2 --transport tcp --streams 8 --split off
b shm-exchange-s8 --members 2 --transport shm --streams 8 --collective exchange
b shm-allreduce-s8 --members 2 --transport shm --streams 8
# The same with every member copying the owners' results (--peer-writes off:
# the direct path before issue 12's write-through), for a before/after in
# one run.
b shm-allreduce-s8-copy --members 2 --transport shm --streams 8 --peer-writes off
b tcp-allreduce-4m-s8 --members 4 --transport tcp --streams 8
b shm-allreduce-4m-s8 --members 4 --transport shm --streams 8
b shm-allreduce-4m-s8-copy --members 4 --transport shm --streams 8 --peer-writes off
for n in 2 4; do
  s=$(date +%s)
  timeout -k 5 "$limit" "$PY" bench/gloo_allreduce.py --members "$n" --sizes "$sizes" --iters "$iters" --min-time "$mintime" | tag "gloo-$n" >> "$rows"
  echo "== gloo-$n: rc=${PIPESTATUS[0]} in $(( $(date +%s) - s ))s"
done
"$PY" bench/report.py "$rows" "$(nproc --all)-core GPU host (CPUs only), commit $GB_COMMIT" > "$out/report.md"
cat "$out/report.md"
echo "== rows: $(wc -l < "$rows") in $rows"
exit "$failed"
