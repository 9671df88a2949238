#!/usr/bin/env bash
# gbbridge's benchmarks and their anchors, in one run on one machine:
#   - memcpy (one core) and the raw 2-member TCP exchange (the ceiling),
#   - iperf3 over loopback (when installed),
#   - gbbridge all_reduce over TCP (streams 1..16, CRC on and off, 8 streams
#     with --split off too) and shm,
#     2 and 4 members, 1 MiB … 1 GiB,
#   - torch Gloo all_reduce, 2 and 4 ranks, the same sizes.
# Usage: bench/run.sh OUTDIR [BIN] [PYTHON]
# Writes OUTDIR/rows.jsonl (every row, schema gpubridge.bench/v1 plus a
# "config" field) and OUTDIR/env.txt; bench/report.py makes the tables.
# GB_SIZES, GB_ITERS: the sizes and timed calls; GB_MIN_TIME (seconds,
# default 0.2): more timed calls where calls are short, until they fill it
# (gbbridge bench --min-time, and the same rule for Gloo; 0: GB_ITERS
# calls at every size); GB_ONLY: an extended
# regular expression, only the configurations it matches run (gloo-2,
# gloo-4 and iperf3 included), e.g. GB_ONLY='-s8$|^memcpy$|^gloo'.
set -uo pipefail
out=${1:?usage: run.sh OUTDIR [BIN] [PYTHON]}
bin=${2:-bin}
py=${3:-python3}
mkdir -p "$out"
rows=$out/rows.jsonl
: > "$rows"
sizes=${GB_SIZES:-1M,4M,16M,64M,256M,1G}
iters=${GB_ITERS:-3}
mintime=${GB_MIN_TIME:-0.2}
here=$(cd "$(dirname "$0")" && pwd)

{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo "${GB_COMMIT:-unknown}")"
  echo "host: $(hostname), $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
  echo "cpu: $(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)"
  echo "gbbridge: $("$bin/gbbridge" --version)"
  echo "torch: $("$py" -c 'import torch; print(torch.__version__)' 2>&1)"
} > "$out/env.txt"
cat "$out/env.txt" >&2

tag() { "$py" "$here/tag_rows.py" "$1"; }  # rows of stdin, "config" set

only=${GB_ONLY:-.}
bench() { # bench CONFIG ARGS...
  local cfg=$1; shift
  [[ $cfg =~ $only ]] || return 0
  echo "== $cfg: gbbridge bench $*" >&2
  "$bin/gbbridge" bench --json --iters "$iters" --warmup 1 --min-time "${mintime}s" "$@" | tag "$cfg" >> "$rows" \
    || echo "!! $cfg failed" >&2
}

bench memcpy --members 2 --transport shm --streams 4 --collective memcpy --sizes "$sizes"
for s in 1 2 4 8 16; do
  bench "tcp-exchange-s$s" --members 2 --transport tcp --streams "$s" --collective exchange --sizes "$sizes"
  bench "tcp-allreduce-s$s" --members 2 --transport tcp --streams "$s" --collective all_reduce --sizes "$sizes"
done
bench tcp-allreduce-s8-nosplit --members 2 --transport tcp --streams 8 --split off --collective all_reduce --sizes "$sizes"
bench tcp-allreduce-s4-crc --members 2 --transport tcp --streams 4 --crc --collective all_reduce --sizes "$sizes"
bench tcp-exchange-s4-crc --members 2 --transport tcp --streams 4 --crc --collective exchange --sizes "$sizes"
for s in 4 8 16; do
  bench "shm-exchange-s$s" --members 2 --transport shm --streams "$s" --collective exchange --sizes "$sizes"
  bench "shm-allreduce-s$s" --members 2 --transport shm --streams "$s" --collective all_reduce --sizes "$sizes"
done
bench shm-allreduce-s4-crc --members 2 --transport shm --streams 4 --crc --collective all_reduce --sizes "$sizes"
for s in 4 8; do
  bench "tcp-allreduce-4m-s$s" --members 4 --transport tcp --streams "$s" --collective all_reduce --sizes "$sizes"
  bench "shm-allreduce-4m-s$s" --members 4 --transport shm --streams "$s" --collective all_reduce --sizes "$sizes"
done

for n in 2 4; do
  [[ gloo-$n =~ $only ]] || continue
  echo "== gloo, $n ranks" >&2
  "$py" "$here/gloo_allreduce.py" --members "$n" --sizes "$sizes" --iters "$iters" --min-time "$mintime" | tag "gloo-$n" >> "$rows" \
    || echo "!! gloo $n failed" >&2
done

if ! [[ iperf3 =~ $only ]]; then
  :
elif command -v iperf3 >/dev/null 2>&1; then
  echo "== iperf3 loopback, 1 and 4 streams, bidirectional" >&2
  iperf3 -s -1 -p 5299 >/dev/null 2>&1 &
  sleep 0.5
  for p in 1 4; do
    iperf3 -c 127.0.0.1 -p 5299 -t 5 -P "$p" --bidir -J > "$out/iperf3-$p.json" 2>/dev/null || true
    iperf3 -s -1 -p 5299 >/dev/null 2>&1 &
    sleep 0.5
  done
  kill %% 2>/dev/null
  "$py" - "$out" >> "$rows" <<'PY'
import json, os, sys
out = sys.argv[1]
for p in (1, 4):
    f = os.path.join(out, f"iperf3-{p}.json")
    try:
        d = json.load(open(f))
        end = d["end"]
        fwd = end["sum_sent"]["bits_per_second"] / 8e9
        rev = end.get("sum_sent_bidir_reverse", {}).get("bits_per_second", 0) / 8e9
        # iperf3 only moves bytes: nothing is checked. Its version is kept,
        # since how --bidir uses threads changed in 3.16.
        print(json.dumps({"schema": "gpubridge.bench/v1", "collective": "iperf3", "config": f"iperf3-P{p}-bidir",
                          "members": 2, "transport": f"iperf3 loopback, {p} streams, --bidir",
                          "iperf3_version": d.get("start", {}).get("version", "unknown"),
                          "algbw_gbps": fwd + rev, "forward_gbps": fwd, "reverse_gbps": rev, "size": 0, "wrong": 0,
                          "checked": False}))
    except Exception as e:  # noqa: BLE001
        print(f"iperf3 {p}: {e}", file=sys.stderr)
PY
else
  echo "== iperf3 not installed: skipped (apt-get install iperf3)" >&2
fi
echo "rows: $(wc -l < "$rows") in $rows" >&2
