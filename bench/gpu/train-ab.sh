#!/usr/bin/env bash
# DDP training throughput with a setting on and off, alternating, from the
# repository root:
#   GB_A_ENV="VAR=VALUE ..." GB_B_ENV="VAR=VALUE ..." bash bench/gpu/train-ab.sh [PAIRS]
# Each of PAIRS (default 2) runs bench/gpu/plugin_train.py gpubridge (the
# 110M LLaMA, DDP, GB_STEPS timed steps, default 20) as two torchrun nodes of
# one rank (bench/gpu/two_nodes.sh: with one GPU, a split test of two
# islands sharing it; GB_TRAIN_ARGS adds arguments, "--device cpu --tiny"
# for a smoke test without GPUs) under side A's variables, then under B's; the side
# that goes first swaps every pair. Writes $OUT/train-ab.jsonl
# (plugin_train's rows, "side" and "env" added) and train-ab.log; prints
# every run's tokens/s and each side's median. Exit status 1 when a run
# failed or its parameters were not identical on both ranks.
set -uo pipefail
out=${OUT:-/tmp/gpubridge-out}; mkdir -p "$out"
exec > >(tee "$out/train-ab.log") 2>&1
. bench/gpu/two_nodes.sh
rows=$out/train-ab.jsonl; : > "$rows"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
fail=0
for k in $(seq 1 "${1:-2}"); do
  order="A B"; [ $((k % 2)) -eq 0 ] && order="B A"
  for side in $order; do
    extra=${GB_A_ENV:-}; [ "$side" = B ] && extra=${GB_B_ENV:-}
    read -r -a vars <<< "$extra"
    tmp=$work/$side-$k.jsonl
    ( for v in "${vars[@]}"; do export "${v?}"; done
      # shellcheck disable=SC2086 # GB_TRAIN_ARGS: words
      two_nodes 150 "$work/node.log" bench/gpu/plugin_train.py gpubridge "$tmp" --steps "${GB_STEPS:-20}" ${GB_TRAIN_ARGS:-} ) ||
      { fail=1; echo "pair $k side $side failed:"; tail -5 "$work/node.log.0"; }
    python3 - "$tmp" "$side" "$extra" "$k" >> "$rows" <<'PY' || fail=1
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line); r["side"] = sys.argv[2]; r["env"] = sys.argv[3]
    print(f"pair {sys.argv[4]} side {r['side']}: {r['tokens_per_s_total']:,.0f} tokens/s, params in sync {r['params_in_sync']}",
          file=sys.stderr)
    if not r["params_in_sync"]:
        sys.exit(1)
    print(json.dumps(r))
PY
  done
done
python3 - "$rows" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for side in "AB":
    v = [r["tokens_per_s_total"] for r in rows if r["side"] == side]
    if v:
        print(f"side {side} ({len(v)} runs, {rows[[r['side'] for r in rows].index(side)]['env']!r}): "
              f"median {statistics.median(v):,.0f} tokens/s ({', '.join(f'{x:,.0f}' for x in v)})")
PY
exit $fail
