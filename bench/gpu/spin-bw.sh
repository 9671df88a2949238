#!/usr/bin/env bash
# What serve's shm spin costs the large calls, from the repository root:
#   bash bench/gpu/spin-bw.sh
# The direct shm all_reduce (gbbridge bench, 2 and 4 members as processes on
# this host) with its waiters spinning each of GB_SPINS microseconds
# (default "200 1000": auto's spin and a longer one) before they sleep,
# the spins alternating over GB_PASSES passes (default 2); GB_SIZES (default
# 1M,16M,64M,256M), 3 timed calls or as many as fill 0.2 s. Every row is
# checked element by element (its "wrong" count). Writes $OUT/spin-bw.jsonl
# (gbbridge bench's rows with "config", "spin_us" and "pass" added by
# bench/tag_rows.py) and prints algbw
# per members, size and spin. Needs bin/gbbridge built and carried.
set -uo pipefail
out=${OUT:-/tmp/gpubridge-out}; mkdir -p "$out"
rows=$out/spin-bw.jsonl; : > "$rows"
read -r -a spins <<< "${GB_SPINS:-200 1000}"
fail=0
for k in $(seq 1 "${GB_PASSES:-2}"); do
  for sp in "${spins[@]}"; do
    for m in 2 4; do
      timeout -k 5 120 bin/gbbridge bench --json --members "$m" --transport shm --collective all_reduce \
        --sizes "${GB_SIZES:-1M,16M,64M,256M}" --iters 3 --warmup 1 --min-time 0.2s --spin-us "$sp" 2>>"$out/spin-bw.err" |
        python3 bench/tag_rows.py "shm-allreduce-${m}m-spin$sp" "spin_us=$sp" "pass=$k" >> "$rows"
      rc=${PIPESTATUS[0]}; echo "pass $k spin $sp members $m: rc $rc"; [ "$rc" -eq 0 ] || fail=1
    done
  done
done
python3 - "$rows" <<'PY'
import collections, json, sys
d = collections.defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    d[(r["members"], r["size"], r["spin_us"])].append(r["algbw_gbps"])
for (m, s, sp), v in sorted(d.items()):
    print(f"{m} members, {s >> 20} MiB, spin {sp}: " + " ".join(f"{x:.2f}" for x in v) + " GB/s")
PY
exit $fail
