#!/usr/bin/env bash
# The gpubridge plugin on a GPU host (issue 4, "On the GPU machine"), in one
# run from the repository root: bash bench/gpu/plugin-bench.sh
#
#   bench2-*   bridged all_reduce 1 MiB .. 1 GiB, float32 and bfloat16, 2 ranks
#              on 2 GPUs (split test: 2 islands x 1 GPU): gpubridge, the
#              Gloo-bridge baseline, all-NCCL (bench/gpu/plugin_bench.py)
#   train-*    DDP tokens/s of a 110M LLaMA-style model (bench/gpu/llama.py), 2
#              ranks: all-NCCL, gpubridge split test, gpubridge + its comm hook
#   overhead   4-byte all_reduce, 4 CPU ranks in simulation: gpubridge vs Gloo
#   bench4-*   4 ranks on 2 GPUs as two torchrun "nodes" of 2 ranks on this
#              host (ranks 0,1 and 2,3 on cuda:0,1; islands {0,1} and {2,3},
#              each island's ranks on distinct GPUs): gpubridge and the
#              Gloo-bridge baseline; all-NCCL cannot exist there (two ranks of
#              one communicator on one GPU), see plugin_bench.py's header
#
# Needs bin/ (gbprobe, gbdiscover, gbbridge) built on the dev machine and
# carried; torch with NCCL on the host; 2 GPUs (with fewer, only "overhead"
# runs). Every step runs under `timeout` inside one time budget (GB_BUDGET_S,
# default 470 s), so the whole run ends inside the device's 10-minute call.
# Whatever a step leaves running (gbbridge, workers: found by a tag in their
# environment, so other users' gbbridge processes are never touched) is
# reported and killed by pid after the step.
#
# Writes under $OUT (default /tmp/gpubridge-out): plugin-bench.log (this
# output), bench.jsonl, train.jsonl, overhead.jsonl, summary.md (tables and
# the issue's goals, met or not), logs.tgz (one log per step).
#
# Settings: GB_STEPS="bench2 train ..." runs only the steps whose names start
# with one of the words; GB_COMMIT names the commit where git is missing;
# PYTHON (default python3); GB_BENCH_ARGS / GB_TRAIN_ARGS are added to every
# plugin_bench.py / plugin_train.py command (e.g. "--sizes 1M,1G",
# "--batch 8"); GB_NODE1_VISIBLE="1,0" gives the second torchrun node of the
# 4-rank steps the GPUs in reverse, so that the two island leaders (LOCAL_RANK
# 0 of each node) are on different GPUs (by default both are on cuda:0 and
# share its host link); GB_DEVICE=cpu smoke-tests this script without GPUs
# (Gloo for NCCL, gpubridge in simulation; pair it with small GB_*_ARGS).
set -uo pipefail

if [ "${1:-}" = "__two_nodes" ]; then
  # Internal: two torchrun "nodes" of 2 ranks each on this host. Args: PORT SCRIPT ARGS...
  shift; port=$1; shift
  pids=()
  for k in 0 1; do
    # GB_NODE1_VISIBLE (e.g. "1,0") reorders the second node's GPUs, so that
    # its leader (LOCAL_RANK 0) is not on the first node's leader's GPU.
    envs=(GB_LAUNCH="2 torchrun nodes x 2 ranks, one host")
    if [ "$k" = 1 ] && [ -n "${GB_NODE1_VISIBLE:-}" ]; then
      envs=(GB_LAUNCH="2 torchrun nodes x 2 ranks, one host, node 1 CUDA_VISIBLE_DEVICES=$GB_NODE1_VISIBLE"
            CUDA_VISIBLE_DEVICES="$GB_NODE1_VISIBLE")
    fi
    env "${envs[@]}" "${PY:-python3}" -m torch.distributed.run \
      --nnodes 2 --node-rank "$k" --nproc-per-node 2 --master-addr 127.0.0.1 --master-port "$port" \
      --max-restarts 0 "$@" &
    pids+=($!)
  done
  # When one node fails, stop the other rather than let it wait for its peer.
  rc=0; left=${#pids[@]}; declare -A done_
  while (( left > 0 )); do
    for p in "${pids[@]}"; do
      [ -n "${done_[$p]:-}" ] && continue
      if ! kill -0 "$p" 2>/dev/null; then
        wait "$p"; r=$?; done_[$p]=1; left=$((left - 1))
        if (( r != 0 )); then
          (( rc == 0 )) && rc=$r
          for q in "${pids[@]}"; do [ -z "${done_[$q]:-}" ] && kill "$q" 2>/dev/null; done
        fi
      fi
    done
    sleep 0.5
  done
  exit "$rc"
fi

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export GPUBRIDGE_BIN_DIR=$PWD/bin PYTHONPATH=$PWD/torchplugin${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PY=${PYTHON:-python3}; export PY
out=${OUT:-/tmp/gpubridge-out}; mkdir -p "$out/logs"
rm -f "$out"/{bench,train,overhead}.jsonl "$out"/summary.md "$out"/logs.tgz "$out"/logs/*.log
exec > >(tee "$out/plugin-bench.log") 2>&1

budget=${GB_BUDGET_S:-470}
t_begin=$(date +%s)
GB_COMMIT=${GB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}; export GB_COMMIT
echo "== $(date -u +%FT%TZ) plugin-bench: commit $GB_COMMIT; $(nproc --all) cores; budget ${budget}s; out $out"
nvidia-smi -L 2>/dev/null || echo "(no nvidia-smi)"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
  "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)'
ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
for t in gbprobe gbdiscover gbbridge; do
  [ -x "bin/$t" ] || { echo "bin/$t is missing: build with 'make build' and carry bin/"; exit 2; }
done
bin/gbbridge --version 2>/dev/null | head -1

failed=()
summary_lines=()

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

wanted() {  # wanted STEP: is STEP selected by GB_STEPS (all when unset)?
  [ -z "${GB_STEPS:-}" ] && return 0
  local w; for w in $GB_STEPS; do [[ $1 == "$w"* ]] && return 0; done
  return 1
}

cleanup() {  # cleanup STEP TAG "GBBRIDGE PIDS BEFORE": report and end what the step left running
  # Only processes carrying the step's tag in their environment (inherited by
  # torchrun, the workers and the gbbridge they spawn) are ours: other users
  # of this host may run gbbridge too.
  local d p mine=() names
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    [ "$p" = "$$" ] && continue
    tr '\0' '\n' 2>/dev/null < "$d/environ" | grep -qxF "$2" && mine+=("$p")
  done
  if (( ${#mine[@]} )); then
    names=$(ps -o comm= -p "${mine[@]}" 2>/dev/null | sort | uniq -c | xargs)
    echo "   LEFTOVER after $1: pids ${mine[*]} ($names); killing them"
    ps -o pid,ppid,etime,args -p "${mine[@]}" || true
    kill "${mine[@]}" 2>/dev/null; sleep 1
    kill -9 "${mine[@]}" 2>/dev/null || true
    summary_lines+=("$1: left processes behind: $names")
  fi
  # gbbridge processes that appeared during the step without the tag (spawned
  # with a scrubbed environment, or someone else's): reported, not touched.
  for p in $(pgrep -x gbbridge); do
    [[ " $3 ${mine[*]} " == *" $p "* ]] && continue
    echo "   note: gbbridge pid $p appeared during $1 without the step's tag; not killed"
    ps -o pid,ppid,etime,args -p "$p" || true
  done
}

step() {  # step NAME LIMIT_S CMD...: one step under timeout, its log in logs/NAME.log
  local name=$1 limit=$2; shift 2
  wanted "$name" || return 0
  local left=$(( budget - ($(date +%s) - t_begin) ))
  if (( left < 30 )); then
    echo "== $name: SKIPPED, ${left}s of the budget left"; failed+=("$name(no time)"); return 0
  fi
  (( limit > left )) && limit=$left
  echo "== $name (limit ${limit}s): $*"
  local s rc
  s=$(date +%s)
  local tag="GB_PLUGIN_BENCH_STEP=$$.$name" before
  before=$(pgrep -x gbbridge | xargs)
  env "$tag" timeout -k 10 "$limit" "$@" > "$out/logs/$name.log" 2>&1; rc=$?
  echo "   rc=$rc in $(( $(date +%s) - s ))s$([ "$rc" = 124 ] && echo ' (TIMED OUT)')"
  grep -E '^(plugin_|mode  |gpubridge |gloo-bridge |nccl )' "$out/logs/$name.log"
  if [ "$rc" != 0 ]; then
    failed+=("$name(rc=$rc)")
    echo "   --- last lines of logs/$name.log"
    grep -v -E '^(W|I)[0-9]{4} ' "$out/logs/$name.log" | tail -25 | sed 's/^/   | /'
  fi
  cleanup "$name" "$tag" "$before"
}

# torchrun, one node of N ranks: "${one[@]}" N SCRIPT ARGS...
one=("$PY" -m torch.distributed.run --standalone --max-restarts 0 --nproc-per-node)
two=(bash "$0" __two_nodes)
bench="$out/bench.jsonl"; train="$out/train.jsonl"; over="$out/overhead.jsonl"
# GB_DEVICE=cpu: a smoke test of this script on a machine without GPUs (Gloo
# for NCCL, simulation for gpubridge); GB_BENCH_ARGS and GB_TRAIN_ARGS are
# added to every plugin_bench.py and plugin_train.py command.
read -r -a bargs <<< "${GB_BENCH_ARGS:-}"
read -r -a targs <<< "${GB_TRAIN_ARGS:-}"
if [ "${GB_DEVICE:-cuda}" = cpu ]; then
  bargs+=(--device cpu); targs+=(--device cpu); ngpu=2
fi
B=(bench/gpu/plugin_bench.py); T=(bench/gpu/plugin_train.py)
if (( ngpu >= 2 )); then
  step bench2-gpubridge 110 "${one[@]}" 2 "${B[@]}" gpubridge "$bench" "${bargs[@]}"
  step bench2-gloo-bridge 130 "${one[@]}" 2 "${B[@]}" gloo-bridge "$bench" "${bargs[@]}"
  step bench2-nccl 70 "${one[@]}" 2 "${B[@]}" nccl "$bench" "${bargs[@]}"
  step train-nccl 100 "${one[@]}" 2 "${T[@]}" nccl "$train" "${targs[@]}"
  step train-gpubridge 120 "${one[@]}" 2 "${T[@]}" gpubridge "$train" "${targs[@]}"
else
  echo "== $ngpu GPU(s): the GPU steps need 2; only the CPU overhead step runs"
fi
step overhead 90 "${one[@]}" 4 bench/gpu/plugin_overhead.py "$over"
if (( ngpu >= 2 )); then
  step bench4-gpubridge 120 "${two[@]}" "$(free_port)" "${B[@]}" gpubridge "$bench" "${bargs[@]}"
  step bench4-gloo-bridge 140 "${two[@]}" "$(free_port)" "${B[@]}" gloo-bridge "$bench" "${bargs[@]}"
  step train-gpubridge-hook 120 "${one[@]}" 2 "${T[@]}" gpubridge "$train" --comm-hook "${targs[@]}"
fi

echo "== summary"
"$PY" bench/gpu/plugin_bench.py summary "$out" > "$out/summary.md"
{
  echo "commit $GB_COMMIT, $(nvidia-smi -L 2>/dev/null | wc -l) GPU(s), $(date -u +%FT%TZ)"
  for l in "${summary_lines[@]}"; do echo "- $l"; done
  (( ${#failed[@]} )) && echo "- steps that failed: ${failed[*]}"
} >> "$out/summary.md"
cat "$out/summary.md"
(cd "$out" && tar czf logs.tgz logs && rm -rf logs)
echo "== done in $(( $(date +%s) - t_begin ))s; failed: ${failed[*]:-none}"
(( ${#failed[@]} == 0 ))
