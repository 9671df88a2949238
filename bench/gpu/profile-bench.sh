#!/usr/bin/env bash
# Where the host bridge's time goes (issue 12), ~1 minute, from the
# repository root: bash bench/gpu/profile-bench.sh
#
# First a small matrix of the 4-member shm all_reduce at 256 KiB .. 4 MiB
# (its fixed cost per call) against fewer streams and one reducing worker,
# and the 2-member direct path at the same sizes; then a few gbbridge bench
# runs with every member's CPU profile (GPUBRIDGE_CPUPROFILE) and Go
# execution trace (GPUBRIDGE_GOTRACE): the 4-member shm all_reduce at 1 MiB
# and 64 MiB, the 2-member shm at 256 MiB, the 2-member TCP all_reduce and
# exchange at 256 MiB. Read them on the dev machine with the same binary:
#   go tool pprof -top bin/gbbridge cpu.0
#   go tool trace -pprof=sync trace.0 > sync.pprof (sched, syscall likewise)
#
# Needs bin/gbbridge built on the dev machine and carried. Writes under $OUT
# (default /tmp/gpubridge-out): rows.jsonl (every row, "config" added),
# profile-bench.log, and per profiled run NAME/cpu.RANK and NAME/trace.RANK.
# GB_LIMIT_S bounds each command (60).
set -uo pipefail
out=${OUT:-/tmp/gpubridge-out}; mkdir -p "$out"
exec > >(tee "$out/profile-bench.log") 2>&1
PY=${PYTHON:-python3}
GB_COMMIT=${GB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
echo "== $(date -u +%FT%TZ) profile-bench: commit $GB_COMMIT; $(nproc --all) cores; $(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)"
[ -x bin/gbbridge ] || { echo "bin/gbbridge is missing: build with 'make build' and carry bin/"; exit 2; }
rows=$out/rows.jsonl; : > "$rows"
limit=${GB_LIMIT_S:-60}
failed=0
tag() { "$PY" bench/tag_rows.py "$1"; }  # rows of stdin, "config" set
b() {  # b CONFIG ARGS...: one bench run, its rows tagged CONFIG
  local cfg=$1; shift
  local s=$(date +%s)
  timeout -k 5 "$limit" bin/gbbridge bench --json --warmup 2 "$@" 2>"$out/$cfg.err" | tag "$cfg" >> "$rows"
  local rc=${PIPESTATUS[0]}
  echo "== $cfg: rc=$rc in $(( $(date +%s) - s ))s: $(grep -h "\"$cfg\"" "$rows" | "$PY" -c 'import json,sys
print("; ".join("%s %.3f ms" % (r["size"], r["time_us"] / 1e3) for r in map(json.loads, sys.stdin)))' 2>&1)"
  (( rc == 0 )) || { failed=1; tail -5 "$out/$cfg.err"; }
}
p() {  # p NAME ARGS...: b with every member's CPU profile and execution trace under NAME/
  local name=$1; shift
  mkdir -p "$out/$name"
  GPUBRIDGE_CPUPROFILE=$out/$name/cpu GPUBRIDGE_GOTRACE=$out/$name/trace b "$name" "$@"
}
small=256K,1M,4M
b shm-4m-s8 --members 4 --transport shm --streams 8 --sizes $small --iters 200
b shm-4m-s2 --members 4 --transport shm --streams 2 --sizes $small --iters 200
b shm-4m-s1 --members 4 --transport shm --streams 1 --sizes $small --iters 200
b shm-4m-s8-w1 --members 4 --transport shm --streams 8 --workers 1 --sizes $small --iters 200
b shm-2m-s8 --members 2 --transport shm --streams 8 --sizes $small --iters 200
b tcp-4m-s8 --members 4 --transport tcp --streams 8 --sizes $small --iters 200
p prof-shm-4m-1M --members 4 --transport shm --streams 8 --sizes 1M --iters 300
p prof-shm-4m-64M --members 4 --transport shm --streams 8 --sizes 64M --iters 20
p prof-shm-2m-256M --members 2 --transport shm --streams 8 --sizes 256M --iters 10
p prof-tcp-2m-256M --members 2 --transport tcp --streams 8 --sizes 256M --iters 10
p prof-tcp-2m-256M-exchange --members 2 --transport tcp --streams 8 --sizes 256M --iters 10 --collective exchange
echo "== profile-bench done: failed=$failed"
exit $failed
