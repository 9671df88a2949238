#!/usr/bin/env bash
# The 4-byte all_reduce of 4 CPU ranks (bench/gpu/plugin_overhead.py: the
# job's policy, flat and reduce-bridge-broadcast against Gloo's world
# all_reduce) with two builds of the tools, alternating, from the
# repository root:
#   bash bench/gpu/latency-ab.sh A_DIR B_DIR [PAIRS]
# A_DIR and B_DIR hold the tools (gbbridge, gbdiscover, gbprobe; a dir with
# only gbbridge borrows the others from bin/). Each of PAIRS (default 3)
# runs A then B, --rounds GB_ROUNDS (default 2) --iters 500. GPUBRIDGE_SPIN_US is passed
# through (validate.sh's latency step uses 200); GB_A_ENV and GB_B_ENV
# ("VAR=VALUE ...") set variables for one side only, for an A/B of one
# build with a setting on and off. Writes under $OUT (default
# /tmp/gpubridge-out): latency-ab.jsonl (plugin_overhead's rows, "side" A or
# B, "bin" and "env" added) and latency-ab.log; prints the medians per side.
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: bash bench/gpu/latency-ab.sh A_DIR B_DIR [PAIRS]" >&2; exit 2; }
out=${OUT:-/tmp/gpubridge-out}; mkdir -p "$out"
exec > >(tee "$out/latency-ab.log") 2>&1
pairs=${3:-3}
rows=$out/latency-ab.jsonl; : > "$rows"
# Per-run files and the tool dirs (symbolic links) live apart from $OUT,
# which the device tool brings back: only the rows and the log go there.
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
fill() {  # a tools dir with every tool: DIR's own, the rest from bin/
  local d=$1 f
  [ -x "$d/gbbridge" ] || { echo "$d/gbbridge is missing"; exit 2; }
  local full=$work/tools-$(basename "$d"); rm -rf "$full"; mkdir -p "$full"
  for f in bin/*; do ln -s "$PWD/$f" "$full/$(basename "$f")"; done
  for f in "$d"/*; do ln -sf "$(cd "$(dirname "$f")" && pwd)/$(basename "$f")" "$full/$(basename "$f")"; done
  echo "$full"
}
A=$(fill "$1"); B=$(fill "$2")
fail=0
for k in $(seq 1 "$pairs"); do
  for side in A B; do
    dir=$A; extra=${GB_A_ENV:-}; [ $side = B ] && { dir=$B; extra=${GB_B_ENV:-}; }
    read -r -a extra <<< "$extra"
    tmp=$work/ab-$side-$k.jsonl
    env "${extra[@]}" GPUBRIDGE_BIN_DIR="$dir" PYTHONPATH="$PWD/torchplugin" OMP_NUM_THREADS=1 timeout 90 \
      "${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc-per-node 4 --max-restarts 0 \
      bench/gpu/plugin_overhead.py "$tmp" --policies flat,reduce-bridge-broadcast --rounds "${GB_ROUNDS:-2}" --iters 500 \
      > "$work/run.log" 2>&1 || { fail=1; echo "pair $k side $side failed:"; tail -5 "$work/run.log"; }
    grep -h '^plugin_overhead' "$work/run.log" | sed "s/^/pair $k side $side: /"
    python3 - "$tmp" "$side" "$dir" "${extra[*]}" >> "$rows" <<'PY' || fail=1
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line); r["side"] = sys.argv[2]; r["bin"] = sys.argv[3]; r["env"] = sys.argv[4]; print(json.dumps(r))
PY
  done
done
python3 - "$rows" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for side in "AB":
    rs = [r for r in rows if r["side"] == side]
    if not rs:
        continue
    def med(key, sub="median_us"):
        return statistics.median(r[key][sub] for r in rs)
    print(f"side {side} ({len(rs)} runs): gloo {med('gloo'):.1f} us; job's policy {med('gpubridge'):.1f} us "
          f"(p99 {med('gpubridge', 'p99_us'):.0f}); flat {med('policy:flat'):.1f} us (p99 {med('policy:flat', 'p99_us'):.0f}); "
          f"flat/gloo {statistics.median(r['policy:flat:ratio_median'] for r in rs):.3f}x, "
          f"p99 {statistics.median(r['policy:flat:ratio_p99'] for r in rs):.3f}x; "
          f"policy/gloo {statistics.median(r['ratio_median'] for r in rs):.3f}x, p99 {statistics.median(r['ratio_p99'] for r in rs):.3f}x")
PY
exit $fail
