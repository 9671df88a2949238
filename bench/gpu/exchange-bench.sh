#!/usr/bin/env bash
# The GPU leaders' all_reduce with the reduction on the GPU against the old
# host-reduce path (issue 12), on an NVIDIA GPU host, from the repository
# root: bash bench/gpu/exchange-bench.sh   (~1-2 minutes; limit GB_LIMIT_S, 240)
#
# 2 ranks, each the leader of its own island (GPUBRIDGE_SPLIT_TEST=half). With
# ONE GPU both ranks run on it as two torchrun "nodes" of one rank: a split
# test of two islands on one GPU, whose leaders share its one host link (the
# rows say so); with 2+ GPUs, one node of 2 ranks on cuda:0 and cuda:1 (then
# the all-NCCL anchor runs too). bench/gpu/exchange_bench.py does the work;
# see its header for the rows. Needs bin/ (gbprobe, gbdiscover, gbbridge)
# built on the dev machine and carried, torch with CUDA.
#
# Writes under $OUT (default /tmp/gpubridge-out): exchange.jsonl (the rows),
# exchange-bench.log (this output). GB_ARGS is added to the worker's
# arguments (e.g. "--sizes 1G --iters 20"); GB_DEVICE=cpu smoke-tests the
# script without GPUs (simulation, the new path forced with
# GPUBRIDGE_BRIDGE_REDUCE semantics "caller").
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export GPUBRIDGE_BIN_DIR=$PWD/bin PYTHONPATH=$PWD/torchplugin${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PY=${PYTHON:-python3}
out=${OUT:-/tmp/gpubridge-out}; mkdir -p "$out"
rows=$out/exchange.jsonl; : > "$rows"
exec > >(tee "$out/exchange-bench.log") 2>&1
GB_COMMIT=${GB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}; export GB_COMMIT
for t in gbprobe gbdiscover gbbridge; do
  [ -x "bin/$t" ] || { echo "bin/$t is missing: build with 'make build' and carry bin/"; exit 2; }
done
echo "== $(date -u +%FT%TZ) exchange-bench: commit $GB_COMMIT; $(nproc --all) cores"
nvidia-smi -L 2>/dev/null || echo "(no nvidia-smi)"
read -r -a args <<< "${GB_ARGS:-}"
limit=${GB_LIMIT_S:-240}
tag="GB_EXCHANGE_BENCH=$$"
port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
worker=(bench/gpu/exchange_bench.py "$rows" "${args[@]}")
if [ "${GB_DEVICE:-cuda}" = cpu ]; then
  ngpu=0; worker+=(--device cpu)
else
  ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  (( ngpu >= 1 )) || { echo "no GPU (GB_DEVICE=cpu smoke-tests without)"; exit 2; }
  export GPUBRIDGE_SPLIT_TEST=half
fi
run=("$PY" -m torch.distributed.run --max-restarts 0 --master-addr 127.0.0.1 --master-port "$port")
rc=0
if (( ngpu >= 2 )); then
  echo "== one torchrun node of 2 ranks on cuda:0 and cuda:1"
  env "$tag" timeout -k 10 "$limit" "${run[@]}" --nnodes 1 --nproc-per-node 2 "${worker[@]}" || rc=$?
else
  echo "== two torchrun nodes of one rank each$( (( ngpu == 1 )) && echo ', both on cuda:0 (split test on ONE GPU)')"
  pids=()
  for k in 0 1; do
    env "$tag" timeout -k 10 "$limit" "${run[@]}" --nnodes 2 --node-rank "$k" --nproc-per-node 1 "${worker[@]}" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
fi
# Whatever the run left (found by the tag in its environment) is ended by pid.
left=()
for d in /proc/[0-9]*; do
  p=${d#/proc/}; [ "$p" = "$$" ] && continue
  tr '\0' '\n' 2>/dev/null < "$d/environ" | grep -qxF "$tag" && left+=("$p")
done
if (( ${#left[@]} )); then
  echo "LEFTOVER: pids ${left[*]}; killing them"; kill "${left[@]}" 2>/dev/null; sleep 1; kill -9 "${left[@]}" 2>/dev/null
  rc=${rc:-1}; (( rc == 0 )) && rc=1
fi
echo "== rows: $(wc -l < "$rows") in $rows; rc=$rc"
exit "$rc"
