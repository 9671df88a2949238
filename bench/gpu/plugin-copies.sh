#!/usr/bin/env bash
# The GPU leader's copy/bridge overlap, traced (GPUBRIDGE_TRACE_COPIES=1):
# bench/gpu/plugin_profile.py, then DDP training against all-NCCL. (At 3e9f381
# it also compared blocking on each copy with polling the feed meanwhile; no
# difference, so only polling is left.) Needs bin/ carried; output under $OUT
# (one tarball).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export GPUBRIDGE_BIN_DIR=$PWD/bin PYTHONPATH=$PWD/torchplugin OMP_NUM_THREADS=4 GPUBRIDGE_SPLIT_TEST=half
out=${OUT:-/tmp/gpubridge-out}/copies; mkdir -p "$out"
exec > >(tee -a "$out/copies.log") 2>&1
echo "== $(date -u +%FT%TZ) commit ${GB_COMMIT:-unknown}"
tr=(python3 -m torch.distributed.run --standalone --max-restarts 0 --nproc-per-node 2)
for w in poll; do
  echo "== profile"
  GPUBRIDGE_TRACE_COPIES=1 timeout 120 "${tr[@]}" bench/gpu/plugin_profile.py > "$out/profile-$w.jsonl" 2> "$out/profile-$w.log"
  grep -E "MiB:" "$out/profile-$w.log"
  grep -E "rank 0: (26214400|67108864)-byte" "$out/profile-$w.log" | tail -2 | cut -c1-1500
  echo "== train"
  timeout 120 "${tr[@]}" bench/gpu/plugin_train.py gpubridge "$out/train.jsonl" 2> "$out/train-$w.log"
  grep plugin_train "$out/train-$w.log"
done
timeout 100 "${tr[@]}" bench/gpu/plugin_train.py nccl "$out/train.jsonl" 2> "$out/train-nccl.log"; grep plugin_train "$out/train-nccl.log"
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" && rm -rf "$out"
