#!/usr/bin/env bash
# The main job (`make demo`, which builds the tools and the virtualenv first):
#
# 1. Four simulated ranks, 2 NVIDIA + 2 AMD, train a small MLP with
#    DistributedDataParallel on CPU through the gpubridge torch.distributed
#    backend, launched with torchrun as a user would launch
#    examples/ddp_train.py. Rank 0 prints the topology the ranks agreed on,
#    the loss every few steps and the throughput; at the end every rank
#    checks that its parameters are identical, bit for bit, to every other
#    rank's. The job is traced (GPUBRIDGE_TRACE): every rank's collective
#    records are left in ./trace/ (DEMO_TRACE=DIR puts them elsewhere), and
#    `gbtrace summary` of them ends this part.
#    Then the same training again with the gradients compressed on the
#    bridge (fp8 with error feedback: gpubridge.compressed_hook), and the
#    two runs side by side: final loss and the bytes the island leaders sent
#    over the bridge (gbbridge's count, packed bytes for fp8).
# 2. The bridge alone: two island leaders all-reduce float32 buffers through
#    gbbridge, verified element by element, with their bandwidth.
#
# Usage: ci/demo.sh [BIN_DIR]  (default: the repository's bin/). The Python
# is .venv/bin/python, or $GPUBRIDGE_PYTHON.
#
# stdout: JSON lines, each with "schema": "gpubridge.demo/v1" and a "kind":
#   topology  world_size, run_kind, simulated, digest, islands[] (label,
#             vendor, backend, ranks, leader), bridge (members, transport, reason)
#   step      epoch, step, loss (averaged over the ranks), samples_per_s
#   result    world_size, steps, parameters, seconds, samples_per_s,
#             final_loss, compression, error_feedback, bridge_bytes_sent,
#             params_identical, param_sha256 (one per training run)
#   compression  exact and fp8 (each final_loss, bridge_bytes_sent) and
#             bytes_ratio (exact / fp8)
#   trace     dir (the trace's directory) and summary (gbtrace summary's rows,
#             schema gpubridge.trace-summary/v1)
#   bridge    one gbbridge bench row (schema gpubridge.bench/v1) under "bench"
# stderr: progress. Exit status 0 when everything passed, 1 when a check
# failed (parameters differ between ranks, wrong elements), 2 when the demo
# could not run.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bin=$(cd "${1:-$repo/bin}" && pwd)
py=${GPUBRIDGE_PYTHON:-$repo/.venv/bin/python}
say() { echo "demo: $*" >&2; }

for t in gbprobe gbdiscover gbbridge gbtrace; do
  [ -x "$bin/$t" ] || { say "$bin/$t is missing: run make build (make demo does)"; exit 2; }
done
[ -x "$py" ] || { say "$py is missing: run make venv (make demo does)"; exit 2; }
"$py" -c 'import torch' 2>/dev/null || { say "$py has no torch: run make venv"; exit 2; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
trace=${DEMO_TRACE:-$PWD/trace}
rm -rf "$trace"

# ---- 1. DDP training through the gpubridge backend ----
# train NAME TRACE_DIR [ddp_train.py args]: runs the example under torchrun
# (JSON lines into $work/NAME.jsonl, copied to stdout; rank 0's progress on
# stderr; traced into TRACE_DIR unless it is empty) and checks that it
# passed with identical parameters on every rank.
train() {
  local name=$1 tracedir=$2 rc result
  shift 2
  set +e
  env -u GPUBRIDGE_VENDOR -u GPUBRIDGE_SPLIT_TEST -u GPUBRIDGE_NAMESPACE -u GPUBRIDGE_COMPRESSION -u GPUBRIDGE_TRACE \
    ${tracedir:+GPUBRIDGE_TRACE="$tracedir"} GPUBRIDGE_SIM_VENDORS=nvidia,nvidia,amd,amd GPUBRIDGE_BIN_DIR="$bin" \
    PYTHONPATH="$repo/torchplugin${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 \
    "$py" -m torch.distributed.run --standalone --nproc-per-node 4 \
    "$repo/examples/ddp_train.py" --json --epochs 4 --max-steps 200 --log-every 25 "$@" \
    2>&1 > "$work/$name.jsonl" \
    | tee "$work/$name.log" | grep --line-buffered -E '^(island|bridge:|training:|epoch|done:)' >&2
  rc=${PIPESTATUS[0]}  # (stderr is filtered to rank 0's progress lines, without torch's per-rank noise)
  set -e
  cat "$work/$name.jsonl"
  result=$(grep '"kind": "result"' "$work/$name.jsonl" || true)
  if [ "$rc" -ne 0 ] || [ -z "$result" ]; then
    say "training failed (torchrun exit $rc):"
    tail -40 "$work/$name.log" >&2
    [ -n "$result" ] && exit 1 || exit 2
  fi
  case "$result" in
    *'"params_identical": true'*) say "every rank ends with identical parameters" ;;
    *) say "parameters differ between ranks"; exit 1 ;;
  esac
}
say "4 simulated ranks (nvidia, nvidia, amd, amd) train with DDP over backend \"gpubridge\" (torchrun, CPU):"
train exact "$trace"
"$bin/gbtrace" summary "$trace" > "$work/summary.jsonl" 2> "$work/summary.log" \
  || { say "gbtrace summary failed:"; cat "$work/summary.log" >&2; exit 1; }
"$py" - "$trace" "$work/summary.jsonl" <<'EOF'
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[2])]
print(json.dumps({"schema": "gpubridge.demo/v1", "kind": "trace", "dir": sys.argv[1], "summary": rows}))
for r in rows:
    top = sorted(r["phases"].items(), key=lambda kv: -kv[1])[:3]
    print(f"  {r['op']:>14} <= {r['bucket_label']:>5} B  x{r['count']:<4} p50 {r['time_p50_us']:9.1f} us  "
          f"busbw {r['busbw_gbps']:6.3f} GB/s  " + ", ".join(f"{k} {v:.0%}" for k, v in top), file=sys.stderr)
EOF
say "every rank's collective records are in $trace/ (gbtrace summary $trace | jq; gbtrace perfetto $trace > job.json)"

say "the same training with the gradients compressed on the bridge (fp8, error feedback: gpubridge.compressed_hook):"
train fp8 "" --compression fp8
"$py" - "$work/exact.jsonl" "$work/fp8.jsonl" <<'EOF'
import json
import sys

runs = {}
for name, path in zip(("exact", "fp8"), sys.argv[1:]):
    res = next(r for r in map(json.loads, open(path)) if r.get("kind") == "result")
    runs[name] = {"final_loss": res["final_loss"], "bridge_bytes_sent": res["bridge_bytes_sent"]}
ratio = runs["exact"]["bridge_bytes_sent"] / max(1, runs["fp8"]["bridge_bytes_sent"])
print(json.dumps({"schema": "gpubridge.demo/v1", "kind": "compression", **runs, "bytes_ratio": round(ratio, 3)}))
for name, r in runs.items():
    print(f"  {name:>5}: final loss {r['final_loss']:.4f}, {r['bridge_bytes_sent']:>10} bytes over the bridge",
          file=sys.stderr)
print(f"  fp8 sent {ratio:.2f}x fewer bytes over the bridge", file=sys.stderr)
EOF

# ---- 2. the bridge alone ----
say "the bridge alone: 2 leaders all-reduce float32 buffers through gbbridge (shm), verified:"
"$bin/gbbridge" bench --members 2 --transport shm --collective all_reduce --sizes 4K,1M,64M --iters 3 \
  --json > "$work/bench.jsonl" 2> "$work/bench.log" || { say "gbbridge bench failed:"; cat "$work/bench.log" >&2; exit 1; }
sed 's/^/{"schema": "gpubridge.demo\/v1", "kind": "bridge", "bench": /; s/$/}/' "$work/bench.jsonl"
"$py" - "$work/bench.jsonl" <<'EOF' || { say "the bridge returned wrong elements"; exit 1; }
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1])]
for r in rows:
    print(f"  {r['size']:>10} B  {r['time_us']:10.1f} us  {r['algbw_gbps']:6.2f} GB/s  #wrong {r['wrong']}",
          file=sys.stderr)
wrong = sum(r["wrong"] for r in rows)
sys.exit(1 if wrong or not rows else 0)
EOF
say "every element of every all_reduce equals the exact sum over both leaders (#wrong 0)"
say "passed"
