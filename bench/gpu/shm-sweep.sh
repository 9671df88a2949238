#!/usr/bin/env bash
# The direct shm all_reduce over a grid of streams and reducing workers
# (issue 12: is its per-call cost the goroutines several members start on
# one host?), from the repository root:
#   bash bench/gpu/shm-sweep.sh
# GB_MEMBERS (default "2 4"), GB_STREAMS ("8 4 2"), GB_WORKERS ("0 4 8";
# 0: one per CPU, the default), GB_SIZES (16M,64M,256M), GB_ITERS (5),
# GB_MIN_TIME (0.2 s: more timed calls where calls are short);
# GB_ARGS adds gbbridge bench arguments to every run. Every row is checked
# element by element (gbbridge bench). Writes $OUT/rows.jsonl (config
# "shm-<members>m-s<streams>-w<workers>") and a table of GB/s on stdout.
set -uo pipefail
out=${OUT:-/tmp/gpubridge-out}; mkdir -p "$out"
PY=${PYTHON:-python3}
[ -x bin/gbbridge ] || { echo "bin/gbbridge is missing: build with 'make build' and carry bin/"; exit 2; }
rows=$out/rows.jsonl; : > "$rows"
read -r -a extra <<< "${GB_ARGS:-}"
fail=0
for m in ${GB_MEMBERS:-2 4}; do
  for s in ${GB_STREAMS:-8 4 2}; do
    for w in ${GB_WORKERS:-0 4 8}; do
      cfg=shm-${m}m-s$s-w$w
      timeout -k 5 120 bin/gbbridge bench --json --members "$m" --transport shm --streams "$s" --workers "$w" \
        --sizes "${GB_SIZES:-16M,64M,256M}" --iters "${GB_ITERS:-5}" --warmup 1 --min-time "${GB_MIN_TIME:-0.2}s" "${extra[@]}" 2>"$out/$cfg.err" |
        "$PY" bench/tag_rows.py "$cfg" >> "$rows"
      [ "${PIPESTATUS[0]}" -eq 0 ] || { fail=1; echo "$cfg failed:"; tail -3 "$out/$cfg.err"; }
    done
  done
done
"$PY" - "$rows" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
sizes = sorted({r["size"] for r in rows})
print("| config | " + " | ".join(f"{s >> 20} MiB" for s in sizes) + " | wrong |")
print("|---|" + "---|" * (len(sizes) + 1))
for cfg in dict.fromkeys(r["config"] for r in rows):
    by = {r["size"]: r for r in rows if r["config"] == cfg}
    print(f"| {cfg} | " + " | ".join(f"{by[s]['algbw_gbps']:.2f}" if s in by else "-" for s in sizes)
          + f" | {sum(r['wrong'] for r in by.values())} |")
PY
exit $fail
