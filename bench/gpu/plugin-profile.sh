#!/usr/bin/env bash
# Where the plugin's time goes on a GPU host (issue 4's shortfalls): the
# bridged all_reduce split into D2H copy, bridge alone, H2D copy and the
# overlapped whole (bench/gpu/plugin_profile.py, two copy-chunk sizes); gbbridge
# bench alone with 1, 2, 4 and 8 shm rings; DDP tokens/s with the backend's
# own step times (stats()) at DDP's default 25 MB buckets and at 100 MB,
# against all-NCCL in the same run; the 4-byte per-call overhead; and a
# CPU-only run with real vendor detection (GPUBRIDGE_CPU_ONLY, split test).
# Needs bin/ carried. Output under $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export GPUBRIDGE_BIN_DIR=$PWD/bin PYTHONPATH=$PWD/torchplugin OMP_NUM_THREADS=4
out=${OUT:-/tmp/gpubridge-out}/profile; mkdir -p "$out"
exec > >(tee -a "$out/profile.log") 2>&1
# run's own lines go to the log (fd 3), never into the JSON lines a command's
# stdout is redirected to (they once landed in profile.jsonl).
exec 3>&1
echo "== $(date -u +%FT%TZ) commit ${GB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
run() { local s; s=$(date +%s); echo "== $*" >&3; timeout -k 5 "$@"; echo "   rc=$? in $(( $(date +%s) - s ))s" >&3; }
tr=(python3 -m torch.distributed.run --standalone --max-restarts 0 --nproc-per-node)
for c in 8388608 33554432; do
  GPUBRIDGE_SPLIT_TEST=half GPUBRIDGE_COPY_CHUNK=$c run 120 "${tr[@]}" 2 bench/gpu/plugin_profile.py >> "$out/profile.jsonl" 2> "$out/profile-$c.log"
  grep -E "MiB:" "$out/profile-$c.log"
done
for s in 1 2 4 8; do
  run 90 bin/gbbridge bench --members 2 --transport shm --collective all_reduce --streams $s \
    --sizes 1M,4M,16M,25M,64M,256M --iters 10 --warmup 2 > "$out/bridge-s$s.txt" 2> "$out/bridge-s$s.log"
  sed "s/^/   streams $s: /" "$out/bridge-s$s.txt"
done
T=(bench/gpu/plugin_train.py)
run 100 "${tr[@]}" 2 "${T[@]}" nccl "$out/train.jsonl" 2> "$out/train-nccl.log"; grep plugin_train "$out/train-nccl.log"
for b in 25 100; do
  GPUBRIDGE_SPLIT_TEST=half run 120 "${tr[@]}" 2 "${T[@]}" gpubridge "$out/train.jsonl" --bucket-mb $b 2> "$out/train-gb-$b.log"
  grep plugin_train "$out/train-gb-$b.log"
done
run 100 "${tr[@]}" 4 bench/gpu/plugin_overhead.py "$out/overhead.jsonl" 2> "$out/overhead.log"; grep plugin_overhead "$out/overhead.log"
mkdir -p "$out/cpuonly"
GPUBRIDGE_CPU_ONLY=1 GPUBRIDGE_SPLIT_TEST=half run 200 "${tr[@]}" 4 torchplugin/tests/backend_worker.py real,real,real,real "$out/cpuonly" \
  > "$out/cpuonly.log" 2>&1
python3 - "$out/cpuonly" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("rank*.json")):
    d = json.loads(f.read_text())
    print(f"   cpu-only {f.stem}: ok={d.get('ok')} checks={d.get('checks')} islands={d.get('islands')} "
          f"transport={d.get('transport')} error={str(d.get('error'))[-300:] if d.get('error') else None}")
PY
pgrep -af 'gbbridge serve' && echo "leftover gbbridge found"
cat "$out/profile.jsonl" "$out/train.jsonl" "$out/overhead.jsonl" 2>/dev/null | grep -v '"stats"' | cut -c1-600
echo "== profile done"
# one file back instead of many (the device returns a limited number)
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" && rm -rf "$out"
