#!/usr/bin/env bash
# Issue 5: the plugin on 4 and 8 GPUs (kinds nvidia-h200-x4 / nvidia-h200-x8),
# split tests: GPUBRIDGE_SPLIT_TEST=half labels the first half of the ranks
# one vendor and the rest the other, one rank per GPU (x4: 2 islands x 2 GPUs,
# x8: 2 islands x 4 GPUs). Run from the repository root with bin/ carried, in
# two device calls of under 10 minutes each:
#
#   bash bench/gpu/plugin-multi.sh check   # every collective x dtype x op vs a world NCCL group on the same
#                                       # data, stream semantics, DDP; the DDP and FSDP2 examples
#   bash bench/gpu/plugin-multi.sh bench   # all_reduce 1 MiB..1 GiB: gpubridge vs a Gloo bridge of the
#                                       # leaders vs all-NCCL; tokens/s of the 110M LLaMA: DDP and FSDP2
#                                       # (and on 8 GPUs HSDP with the islands as shard groups, so only
#                                       # the replicate all_reduce crosses the bridge) vs all-NCCL
#
# Output: $OUT/multi-<part>.tgz (logs and JSON lines) and a summary on stdout.
set -uo pipefail
part=${1:?usage: plugin-multi.sh check|bench}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export GPUBRIDGE_BIN_DIR=$PWD/bin PYTHONPATH=$PWD/torchplugin OMP_NUM_THREADS=4 GPUBRIDGE_SPLIT_TEST=half
out=${OUT:-/tmp/gpubridge-out}/multi-$part; mkdir -p "$out"
exec > >(tee -a "$out/run.log") 2>&1
n=$(nvidia-smi -L | wc -l)
echo "== $(date -u +%FT%TZ) commit ${GB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}; $n GPUs; part $part"
if (( n < 4 )); then echo "needs 4 or 8 GPUs (nvidia-h200-x4 / -x8)"; exit 2; fi
tr=(python3 -m torch.distributed.run --standalone --max-restarts 0 --nproc-per-node "$n")
fail=0
run() {  # run NAME LIMIT_S CMD...
  local name=$1 limit=$2 s; shift 2; s=$(date +%s)
  echo "== $name: $*"
  timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1; local rc=$?
  echo "   rc=$rc in $(( $(date +%s) - s ))s"; (( rc == 0 )) || { fail=1; tail -15 "$out/$name.log"; }
  grep -E "^(plugin_|done:)" "$out/$name.log" | tail -3
  if pgrep -f 'gbbridge serve' > /dev/null; then echo "   leftover gbbridge serve:"; pgrep -af 'gbbridge serve'; fail=1; fi
}
case $part in
check)
  mkdir -p "$out/check"
  run check 300 "${tr[@]}" bench/gpu/plugin_check.py "$out/check" nccl
  python3 - "$out/check" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/check.*.json")):
    d = json.load(open(f))
    print(f"   rank {d['rank']}: " + (f"ERROR {d['error'][-800:]}" if "error" in d else
          f"ok checks={d['checks']} {d['device']} islands={d['islands']} bridge={d['bridge']} "
          f"async call {d['async']['call_ms']} ms completed at once {d['async']['completed_at_once']} ddp {d['ddp']['params_identical']}"))
PY
  run ddp-example 200 "${tr[@]}" examples/ddp_train.py
  run fsdp-example 200 "${tr[@]}" examples/fsdp_train.py
  ;;
bench)
  B=(bench/gpu/plugin_bench.py); T=(bench/gpu/plugin_train.py)
  for m in gpubridge gloo-bridge nccl; do run "bench-$m" 150 "${tr[@]}" "${B[@]}" "$m" "$out/bench.jsonl"; done
  run train-nccl-ddp 100 "${tr[@]}" "${T[@]}" nccl "$out/train.jsonl"
  run train-gpubridge-ddp 120 "${tr[@]}" "${T[@]}" gpubridge "$out/train.jsonl"
  run train-nccl-fsdp 100 "${tr[@]}" "${T[@]}" nccl "$out/train.jsonl" --parallel fsdp
  run train-gpubridge-fsdp 150 "${tr[@]}" "${T[@]}" gpubridge "$out/train.jsonl" --parallel fsdp
  if (( n >= 8 )); then
    run train-nccl-hsdp 100 "${tr[@]}" "${T[@]}" nccl "$out/train.jsonl" --parallel hsdp
    run train-gpubridge-hsdp 150 "${tr[@]}" "${T[@]}" gpubridge "$out/train.jsonl" --parallel hsdp
  fi
  python3 bench/gpu/plugin_bench.py summary "$out" > "$out/summary.md" && cat "$out/summary.md"
  ;;
*) echo "unknown part $part"; exit 2 ;;
esac
echo "== done, fail=$fail"
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" && rm -rf "$out"
exit $fail
