#!/usr/bin/env bash
# The 2-member TCP all_reduce beside the exchange it rides on (issue 12),
# ~2-4 minutes, from the repository root: bash bench/gpu/tcp2-ab.sh
#
# Each pass times, in an order that rotates from pass to pass: the exchange
# (the ceiling), the exchange all_reduce (inplace: --split off) and the
# default (ring: two halves); GB_CONFIGS may name ringplain too (the ring
# with --stream off: its last step copies through the caches), and any
# of them with "@b" appended runs with the gbbridge that GB_BBIN names (an
# A/B of two builds in the same passes). Rows carry
# the receivers' summed wait for their own sends (send_wait_us), the bytes
# spilled meanwhile and the reduction's time (member 0's checked call).
# Then one CPU profile per member of the inplace and the ring run at the
# largest size. Read the profiles on the dev machine with the same binary:
#   go tool pprof -top bin/gbbridge inplace-cpu.0
#
# Needs bin/gbbridge built on the dev machine and carried. Writes under $OUT
# (default /tmp/gpubridge-out): rows.jsonl (every row, "config" and "pass"
# added), tcp2-ab.log, and tcp2-ab.tgz: NAME-cpu.RANK per profiled run and
# each run's stderr. GB_PASSES (3), GB_SIZES (64M,256M,1G), GB_ITERS (10),
# GB_STREAMS (8), GB_LIMIT_S per command (60); GB_CONFIGS (the three above),
# GB_ARGS (more gbbridge bench flags for every run, e.g. --tcp-sockbuf 1M),
# GB_TAG (appended to every config name), GB_PROFILE=0 (no profiled runs).
set -uo pipefail
out=${OUT:-/tmp/gpubridge-out}; mkdir -p "$out"
exec > >(tee "$out/tcp2-ab.log") 2>&1
PY=${PYTHON:-python3}
GB_COMMIT=${GB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
echo "== $(date -u +%FT%TZ) tcp2-ab: commit $GB_COMMIT; $(nproc --all) cores; $(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)"
[ -x bin/gbbridge ] || { echo "bin/gbbridge is missing: build with 'make build' and carry bin/"; exit 2; }
rows=$out/rows.jsonl; : > "$rows"
limit=${GB_LIMIT_S:-60}
passes=${GB_PASSES:-3}
sizes=${GB_SIZES:-64M,256M,1G}
common=(--json --members 2 --transport tcp --streams "${GB_STREAMS:-8}" --iters "${GB_ITERS:-10}" --warmup 2)
failed=0
declare -A args=(
  [exchange]="--collective exchange"
  [inplace]="--split off"
  [ring]=""
  [ringplain]="--stream off"
)
read -r -a order <<< "${GB_CONFIGS:-exchange inplace ring}"
read -r -a extra <<< "${GB_ARGS:-}"
tag=${GB_TAG:-}
b() {  # b CONFIG PASS ARGS...: one bench run, its rows tagged
  local cfg=$1 pass=$2; shift 2
  local s=$(date +%s) gb=bin/gbbridge
  [[ $cfg == *@b ]] && gb=${GB_BBIN:?a config ending in @b needs GB_BBIN}
  timeout -k 5 "$limit" "$gb" bench "${common[@]}" --sizes "${bsizes:-$sizes}" "${extra[@]}" "$@" 2>"$out/$cfg.err" |
    "$PY" bench/tag_rows.py "$cfg$tag" pass="$pass" >> "$rows"
  local rc=${PIPESTATUS[0]}
  echo "== $cfg pass $pass: rc=$rc in $(( $(date +%s) - s ))s: $("$PY" -c 'import json,sys
rs = [r for r in map(json.loads, open(sys.argv[1])) if r["config"] == sys.argv[2] and r["pass"] == int(sys.argv[3])]
print("; ".join("%dM %.2f GB/s wait %.0f ms spilled %d MiB" % (r["size"] >> 20, r["algbw_gbps"], r.get("send_wait_us", 0) / 1e3, r.get("spilled_bytes", 0) >> 20) for r in rs))' "$rows" "$cfg$tag" "$pass" 2>&1)"
  (( rc == 0 )) || { failed=1; tail -5 "$out/$cfg.err"; }
}
for (( p = 0; p < passes; p++ )); do
  for (( i = 0; i < ${#order[@]}; i++ )); do
    cfg=${order[$(( (i + p) % ${#order[@]} ))]}
    # shellcheck disable=SC2086
    b "$cfg" "$p" ${args[${cfg%@b}]}
  done
done
big=${sizes##*,}
[ "${GB_PROFILE:-1}" = 0 ] || for cfg in inplace ring; do
  # shellcheck disable=SC2086
  GPUBRIDGE_CPUPROFILE=$out/$cfg-cpu bsizes=$big b "prof-$cfg" 0 ${args[$cfg]}
done
"$PY" - "$rows" "$tag" <<'EOF'
import json, statistics, sys
tag = sys.argv[2]
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows:
    r["config"] = r["config"].removesuffix(tag) if tag else r["config"]
by = {}
for r in rows:
    by.setdefault((r["config"], r["size"]), []).append(r["algbw_gbps"])
sizes = sorted({s for _, s in by})
print("== medians over passes (GB/s), and against the exchange")
for s in sizes:
    ex = statistics.median(by.get(("exchange", s), [float("nan")]))
    line = [f"{s >> 20}M exchange {ex:.2f}"]
    for cfg in sorted({c for c, _ in by} - {"exchange"}):
        v = by.get((cfg, s))
        if v:
            m = statistics.median(v)
            line.append(f"{cfg} {m:.2f} ({m / ex:.2f}x)")
    print("   " + "; ".join(line))
wrong = sum(r["wrong"] for r in rows)
print(f"== rows {len(rows)}, wrong elements {wrong}")
EOF
# A call returns few files: the profiles and stderr files travel packed.
# shellcheck disable=SC2046
tar -C "$out" -czf "$out/tcp2-ab.tgz" --remove-files $(cd "$out" && ls -- *-cpu.* *.err 2>/dev/null)
echo "== tcp2-ab done: failed=$failed"
exit $failed
