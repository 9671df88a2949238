#!/usr/bin/env bash
# The control plane on a GPU machine (issue 2): gbprobe through NVML, and
# gbdiscover in a 2-GPU torchrun job (single vendor, split test, and two ranks
# on one GPU, which must be refused). Needs bin/ built on the dev machine and
# carried. Writes everything under $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp/gpubridge-out}; mkdir -p "$out/runs"
log=$out/control-plane.log
exec > >(tee -a "$log") 2>&1
echo "== $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
nvidia-smi -L
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "nccl", torch.cuda.nccl.version())'
echo "== gbprobe --json"
bin/gbprobe --json > "$out/gbprobe.json"; echo "rc=$?"
cat "$out/gbprobe.json"
echo "== gbprobe --require nvidia,gpus=2,nvml,no-problems"
bin/gbprobe --require nvidia,gpus=2,nvml,no-problems; echo "rc=$?"
echo "== gbprobe --require amd (must fail with exit 1)"
bin/gbprobe --require amd; echo "rc=$?"
echo "== 50 probes"
start=$(date +%s.%N); for _ in $(seq 50); do bin/gbprobe --json > /dev/null; done; end=$(date +%s.%N)
python3 -c "print(f'mean gbprobe wall time: {($end-$start)/50*1000:.1f} ms')"
fail=0
for c in single split-half same-gpu; do
  echo "== torchrun 2 ranks: $c"
  split=""; [ "$c" = split-half ] && split=half
  GPUBRIDGE_SPLIT_TEST=$split timeout 300 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
    --max-restarts 0 bench/gpu/discover_worker.py "$out/runs" "$c" || { echo "case $c FAILED"; fail=1; }
  for r in 0 1; do python3 - "$out/runs/$c.$r.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
t = d.get("topology", {})
print(f"  rank {d['rank']}: rc={d['gbdiscover_rc']} kind={t.get('run_kind')} islands={[ (i['label'], i['ranks']) for i in t.get('islands', [])]} "
      f"bridge={t.get('bridge', {}).get('transport')} gpu={t.get('self', {}).get('gpu', {}).get('uuid')} "
      f"uuid_matches_torch={d.get('uuid_matches_torch')} nccl={d.get('nccl_all_reduce')} problems={t.get('problems')}")
if d["gbdiscover_rc"] != 0:
    print("  stderr:", d["stderr"].strip().replace("\n", "\n    "))
PY
  done
done
(cd "$out" && tar czf runs.tgz runs && rm -rf runs)
echo "== done fail=$fail"
exit $fail
