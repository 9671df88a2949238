#!/usr/bin/env bash
# Pipeline parallelism across islands (issue 16): tokens/s of
# examples/pipeline_train.py (a 2-stage LLaMA-style decoder, GPipe and 1F1B)
# over gpubridge against the same schedule over plain NCCL (GPUs) or Gloo
# (CPU). From the repository root, bin/ built and carried:
#   OUT=dir bash bench/gpu/pipeline-bench.sh
# With 2+ GPUs both runs are 2 ranks on cuda:0 and cuda:1 (gpubridge as a
# split test, GPUBRIDGE_SPLIT_TEST=half); with one GPU gpubridge runs as two
# torchrun "nodes" sharing cuda:0 (two_nodes.sh) and NCCL, which refuses two
# ranks on one GPU, is skipped (a row says so); without a GPU (or
# GB_DEVICE=cpu) it is a CPU simulation against Gloo with a small model.
# GB_PIPE_ARGS replaces the model and batch arguments. Rows (schema
# gpubridge.pipeline/v1, one per rank and run) go to $OUT/pipeline.jsonl;
# the summary (gpubridge / baseline tokens/s per schedule, the issue's goal
# 0.95) to stdout.
set -uo pipefail
out=${OUT:-/tmp/gpubridge-out}; mkdir -p "$out"
rows=$out/pipeline.jsonl; : > "$rows"
export PYTHONPATH=${PYTHONPATH:-$PWD/torchplugin} GPUBRIDGE_BIN_DIR=${GPUBRIDGE_BIN_DIR:-$PWD/bin}
PY=${PYTHON:-python3}
gpus=$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
[ "${GB_DEVICE:-}" = cpu ] && gpus=0
if [ "$gpus" -gt 0 ]; then
  default="--steps 30 --warmup 5 --microbatches 8 --batch-size 32 --seq-len 1024 --dim 768 --layers 12 --heads 12 --vocab 32000 --dtype bfloat16"
else
  default="--steps 12 --warmup 2 --microbatches 4 --batch-size 8 --seq-len 64 --dim 64 --layers 4 --heads 4 --vocab 256"
fi
read -r -a args <<< "${GB_PIPE_ARGS:-$default}"
. bench/gpu/two_nodes.sh
rc=0
run() {  # run NAME BACKEND SCHEDULE: 2 ranks, rows appended
  local name=$1 backend=$2 sched=$3 log=$out/$1-$3.log
  if [ "$gpus" -ne 1 ]; then
    if [ "$gpus" -eq 0 ] && [ "$backend" = gpubridge ]; then export GPUBRIDGE_SIM_VENDORS=nvidia,amd; fi
    if [ "$gpus" -ge 2 ] && [ "$backend" = gpubridge ]; then export GPUBRIDGE_SPLIT_TEST=half; fi
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} timeout "${GB_LIMIT_S:-240}" $PY -m torch.distributed.run --standalone \
      --nproc-per-node 2 --max-restarts 0 examples/pipeline_train.py --backend "$backend" --schedule "$sched" \
      --json "${args[@]}" > "$log" 2>&1 || rc=1
    unset GPUBRIDGE_SIM_VENDORS GPUBRIDGE_SPLIT_TEST
    grep '^{' "$log" >> "$rows"
  elif [ "$backend" = gpubridge ]; then
    GPUBRIDGE_SPLIT_TEST=half two_nodes "${GB_LIMIT_S:-240}" "$log" examples/pipeline_train.py \
      --backend gpubridge --schedule "$sched" --json "${args[@]}" || rc=1
    cat "$log".0 "$log".1 | grep '^{' >> "$rows"
  else
    printf '{"schema":"gpubridge.pipeline/v1","backend":"%s","schedule":"%s","skipped":"one GPU: NCCL refuses two ranks on one GPU"}\n' \
      "$backend" "$sched" >> "$rows"
  fi
  tail -n 3 "$log"* | grep -v '^{' || true
}
base=nccl; [ "$gpus" -eq 0 ] && base=gloo
for sched in gpipe 1f1b; do
  run gpubridge gpubridge "$sched"
  run "$base" "$base" "$sched"
done
$PY - "$rows" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def tps(backend, sched):
    got = [r["tokens_per_s"] for r in rows if r.get("backend") == backend and r.get("schedule") == sched and "tokens_per_s" in r]
    return min(got) if got else None  # the slower stage's view
for sched in ("gpipe", "1f1b"):
    gb = tps("gpubridge", sched)
    base = next((b for b in ("nccl", "gloo") if tps(b, sched)), None)
    ratio = gb / tps(base, sched) if gb and base else None
    print(json.dumps({"schema": "gpubridge.pipeline-summary/v1", "schedule": sched, "gpubridge_tokens_per_s": gb,
                      "baseline": base, "baseline_tokens_per_s": tps(base, sched) if base else None,
                      "ratio": ratio, "goal": 0.95}))
PY
exit $rc
