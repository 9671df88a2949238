#!/usr/bin/env bash
# Rebalancing on a GPU (issue 18), on one H200 in about a minute (under 2):
# a split test of 2 ranks on the one GPU (two torchrun "nodes" of one rank
# each, GPUBRIDGE_SPLIT_TEST=half: two islands, one bridge), DDP of a small
# LLaMA (dim 512, 4 layers, seq 256, bf16) through the gpubridge backend
# with gpubridge.RebalancingSampler and weighted_comm_hook. Rank 1's island
# is slowed by extra bf16 matmuls per sample (REBALANCE_EXTRA x N x N, N =
# REBALANCE_N). Phase 1: even shares; phase 2: rebalanced. Both islands are
# the same H200, so each node declares its class (GPUBRIDGE_HW_CLASS), and
# both ranks share the GPU (its time-slicing between the two processes is
# part of what is measured: rebalancing gains by giving the rank with more
# work per sample fewer samples). Then gbtrace stragglers --hetero on the
# trace: the slowed island is an expected class difference, not a degraded
# rank.
# GB_MPS=1 runs the two ranks under CUDA MPS with half the GPU's SMs each
# (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50; the control daemon is started here
# and quit at the end): the two islands then compute side by side as two
# GPUs would, instead of time-slicing the whole GPU, so the slowed island's
# extra work no longer slows the other (still one GPU: a split test).
# Needs bin/ (gbtrace and the others, built on the dev machine, carried) and
# torchplugin/. Everything goes under $OUT (job/, trace/, hetero.jsonl,
# rebalance.log, and rebalance.jsonl: one row with the tokens/s of both
# phases, the ideal, the plans and the verdicts).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export GPUBRIDGE_BIN_DIR=$PWD/bin PYTHONPATH=$PWD/torchplugin GPUBRIDGE_SPLIT_TEST=half OMP_NUM_THREADS=4
out=${OUT:-/tmp/gpubridge-out}; mkdir -p "$out/job"
exec > >(tee -a "$out/rebalance.log") 2>&1
commit=${GB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
echo "== $(date -u +%FT%TZ) commit $commit"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
fail=0
mps=${GB_MPS:-0}
if [ "$mps" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=$out/mps/pipe CUDA_MPS_LOG_DIRECTORY=$out/mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    trap 'echo quit | nvidia-cuda-mps-control' EXIT
    export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50
    echo "  MPS: control daemon started, 50% of the SMs per process"
  else
    echo "  MPS: nvidia-cuda-mps-control -d failed"; exit 1
  fi
fi
port=$((29700 + RANDOM % 200))
start=$(date +%s)
pids=()
for node in 0 1; do
  slow=$node
  GPUBRIDGE_TRACE=$out/trace GPUBRIDGE_HW_CLASS="h200 island $node$([ "$slow" = 1 ] && echo ' (slowed)')" \
    REBALANCE_SLOW=$slow timeout 170 python3 -m torch.distributed.run \
    --nnodes 2 --node-rank $node --nproc-per-node 1 --max-restarts 0 --master-addr 127.0.0.1 --master-port $port \
    bench/gpu/rebalance_job.py "$out/job" > "$out/job/node$node.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || { echo "FAILED node (rc $?)"; fail=1; }; done
wall=$(( $(date +%s) - start ))
echo "  wall $wall s"
tail -n 3 "$out/job/node0.log" "$out/job/node1.log"
bin/gbtrace stragglers --hetero --all --window 30 --calibrate 30 "$out/trace" > "$out/hetero.jsonl"
echo "  gbtrace stragglers --hetero: exit $? (0: no rank degraded, no slow link)"
bin/gbtrace stragglers --hetero --format text --window 30 --calibrate 30 "$out/trace"
python3 - "$out" "$commit" "$wall" <<'PY' || fail=1
import json, sys
out, commit, wall = sys.argv[1], sys.argv[2], int(sys.argv[3])
res = [json.load(open(f"{out}/job/rank{r}.json")) for r in (0, 1)]
bad = [f"rank {r}: {d.get('error')}" for r, d in enumerate(res) if not d.get("ok")]
if bad:
    print("  FAILED:", bad)
    sys.exit(1)
lines = [json.loads(l) for l in open(f"{out}/hetero.jsonl")]
sys.path.insert(0, "bench")
from rebalance_figures import figures  # the ideal (docs/REBALANCING.md)
seq = res[0]["config"]["seq"]
import os
row = {"schema": "gpubridge.bench-rebalance/v1", "kind": "gpu", "commit": commit, "host": "h200x1",
       "mps_sm_percent": int(os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]) if os.environ.get("GB_MPS") == "1" else None,
       "split_test": "half", "wall_s": wall, "config": res[0]["config"], "global_batch": 32,
       "extra_matmuls_per_sample": res[1]["extra"], "n": res[1]["n"],
       "even_tokens_per_s": res[0]["phases"][0]["tokens_per_s"],
       "rebalanced_tokens_per_s": res[0]["phases"][1]["tokens_per_s"], "speedup": res[0]["speedup"],
       "plans": res[0]["phases"][1]["plans"], "same_plans": res[0]["phases"][1]["plans"] == res[1]["phases"][1]["plans"],
       "verdicts": {x["rank"]: x["verdict"] for x in lines if x["kind"] == "rank"}}
# Windows of 30 steps: 1-2 the even phase's last 60, 4-5 the rebalanced one's.
try:
    f = figures(lines, even=[1, 2], judged=[4, 5], global_batch=32)
    row["figures_samples_per_s"] = f
    row["ideal_tokens_per_s"] = f["ideal_per_s"] * seq
except ValueError as e:
    row["figures_error"] = str(e)
print(json.dumps(row))
open(f"{out}/rebalance.jsonl", "w").write(json.dumps(row) + "\n")
PY
pgrep -f 'gbbridge serve' && { echo "leftover gbbridge found"; fail=1; }
echo "== rebalance done, fail=$fail"
exit $fail
