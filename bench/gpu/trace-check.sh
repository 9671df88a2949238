#!/usr/bin/env bash
# Tracing on a GPU (issue 14), on one H200 in about a minute:
#  1. a split test of 2 ranks on the one GPU (two torchrun "nodes" of one
#     rank each, GPUBRIDGE_SPLIT_TEST=half: two islands, one bridge) traced
#     with GPUBRIDGE_TRACE: 64 MiB all_reduces (the leader's streamed copies)
#     and small ones, compute marked with gpubridge.observe.phase; every
#     record's GPU phases must arrive (record.ready(), no sync), and
#     gbtrace summary / merge / hang / perfetto read the trace; the perfetto
#     JSON must hold GPU tracks;
#  2. torch's own Flight Recorder on an NCCL job of one rank, dumped as
#     pickle and JSON, read by gbtrace fr and summarized.
# Needs bin/ (gbtrace and the others, built on the dev machine, carried) and
# torchplugin/. Everything goes under $OUT (trace/, *.jsonl, perfetto.json,
# nccl-fr/, trace-check.log).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export GPUBRIDGE_BIN_DIR=$PWD/bin PYTHONPATH=$PWD/torchplugin GPUBRIDGE_SPLIT_TEST=half OMP_NUM_THREADS=4
out=${OUT:-/tmp/gpubridge-out}; mkdir -p "$out/job" "$out/nccl-fr"
exec > >(tee -a "$out/trace-check.log") 2>&1
echo "== $(date -u +%FT%TZ) commit ${GB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "nccl", torch.cuda.nccl.version())'
fail=0
echo "== 1. traced split test: 2 ranks (2 islands) on one GPU"
. bench/gpu/two_nodes.sh
start=$(date +%s)
GPUBRIDGE_TRACE=$out/trace GPUBRIDGE_TRACE_DUMP_DIR=$out/dumps two_nodes 240 "$out/job/node.log" \
  bench/gpu/trace_job.py "$out/job" || { echo "FAILED node (rc $?)"; fail=1; }
echo "  wall $(( $(date +%s) - start )) s"
for f in "$out"/job/rank*.json; do echo "  $(basename "$f"): $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); d.pop("dump",None); print(json.dumps(d))' "$f")"; done
tail -3 "$out/job/node.log.0"
bin/gbtrace summary "$out/trace" > "$out/summary.jsonl" || { echo "gbtrace summary FAILED"; fail=1; }
bin/gbtrace summary --format text "$out/trace"
bin/gbtrace merge "$out/trace" > "$out/merge.jsonl" || { echo "gbtrace merge FAILED"; fail=1; }
bin/gbtrace hang --format text "$out/trace" || { echo "gbtrace hang says incomplete"; fail=1; }
bin/gbtrace perfetto "$out/trace" > "$out/perfetto.json" || { echo "gbtrace perfetto FAILED"; fail=1; }
python3 - "$out" <<'PY' || fail=1
import json, sys
out = sys.argv[1]
recs = [json.loads(l) for r in (0, 1) for l in open(f"{out}/trace/rank-{r}.jsonl")]
colls = [r for r in recs if r["kind"] == "collective"]
gpu = [p for r in colls for p in r["phases"] if "gpu_start" in p]
print(f"  trace: {len(colls)} collective records, {len(gpu)} phases with GPU times, "
      f"{sum(1 for r in colls if r.get('gpu'))} written before their GPU times were ready")
ev = json.load(open(f"{out}/perfetto.json"))["traceEvents"]
tracks = {(e["pid"], e["args"]["name"]) for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
ngpu = sum(1 for e in ev if e.get("cat") == "gpu")
print(f"  perfetto: {len(ev)} events, {ngpu} on GPU tracks; tracks {sorted(tracks)}")
bad = [f"rank {d['rank']}: {d.get('error') or 'no GPU phases'}" for d in (json.load(open(f"{out}/job/rank{r}.json")) for r in (0, 1)) if not d.get("ok") or not d.get("gpu_phases")]
if not colls or not gpu or not ngpu or bad:
    print("  FAILED:", bad or "no GPU phases")
    sys.exit(1)
PY
pgrep -f 'gbbridge serve' && { echo "leftover gbbridge found"; fail=1; }
echo "== 2. torch's Flight Recorder on an NCCL job of one rank"
TORCH_NCCL_TRACE_BUFFER_SIZE=100 TORCH_NCCL_ENABLE_TIMING=1 timeout 120 python3 -m torch.distributed.run --standalone \
  --nproc-per-node 1 bench/gpu/nccl_fr.py "$out/nccl-fr" > "$out/nccl-fr/job.log" 2>&1 || { echo "FAILED (rc $?)"; tail -20 "$out/nccl-fr/job.log"; fail=1; }
for f in nccl_trace_rank_0 nccl_trace_rank_0.json; do
  [ -f "$out/nccl-fr/$f" ] || continue
  mkdir -p "$out/nccl-fr/$f.d" && cp "$out/nccl-fr/$f" "$out/nccl-fr/$f.d/"
  bin/gbtrace fr "$out/nccl-fr/$f.d" > "$out/nccl-fr/$f.records.jsonl" || { echo "gbtrace fr $f FAILED"; fail=1; }
  echo "  $f: $(grep -c '"kind":"collective"' "$out/nccl-fr/$f.records.jsonl") collective records"
  bin/gbtrace summary --format text "$out/nccl-fr/$f.d" || fail=1
done
echo "== trace-check done, fail=$fail"
exit $fail
