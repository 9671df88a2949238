#!/usr/bin/env bash
# The gpubridge backend on real GPUs (issue 4): split tests on one host.
#   2 ranks: 2 islands x 1 GPU, checked against a world NCCL group;
#   4 ranks: 2 islands x 2 ranks sharing the 2 GPUs (each island's ranks on
#            distinct GPUs; launched as two torchrun "nodes" of 2 ranks so
#            LOCAL_RANK picks the GPU), checked against a world Gloo group on
#            CPU copies (a world NCCL group cannot have two ranks on one GPU).
# Every collective x dtype x op bit for bit, stream semantics under a busy
# stream, DDP. Needs bin/ (built on the dev machine, carried) and torchplugin/.
# Logs and JSON under $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export GPUBRIDGE_BIN_DIR=$PWD/bin PYTHONPATH=$PWD/torchplugin GPUBRIDGE_SPLIT_TEST=half OMP_NUM_THREADS=4
out=${OUT:-/tmp/gpubridge-out}; mkdir -p "$out/check2" "$out/check4"
log=$out/plugin-check.log
exec > >(tee -a "$log") 2>&1
echo "== $(date -u +%FT%TZ) commit ${GB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "nccl", torch.cuda.nccl.version())'
fail=0
summary() {  # dir
  python3 - "$1" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/check.*.json")):
    d = json.load(open(f))
    if "error" in d:
        print(f"  rank {d['rank']}: ERROR {d['error'][-1500:]}")
    else:
        print(f"  rank {d['rank']}: ok checks={d['checks']} {d['device']} kind={d['run_kind']} split={d['split_test']} "
              f"islands={d['islands']} bridge={d['bridge']} init={d['init_s']}s checks_s={d['checks_s']}s total={d['total_s']}s "
              f"async={ {k: v for k, v in d['async'].items() if k != 'in_flight_while_waiting'} } "
              f"in_flight={[ (e['op'], e['seq'], e['step']) for e in d['async']['in_flight_while_waiting']]} "
              f"ddp={d['ddp']} bridge_exit={d['bridge_exit']} exchanged={d.get('exchanged')}")
PY
}
. bench/gpu/two_nodes.sh
if [ "$ngpu" -ge 2 ]; then
  echo "== split test, 2 ranks (2 islands x 1 GPU) vs world NCCL"
  start=$(date +%s)
  timeout 400 python3 -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 0 \
    bench/gpu/plugin_check.py "$out/check2" nccl || { echo "FAILED (rc $?)"; fail=1; }
  echo "  wall $(( $(date +%s) - start )) s"; summary "$out/check2"
  pgrep -f 'gbbridge serve' && { echo "leftover gbbridge found"; fail=1; }
  echo "== split test, 4 ranks on 2 GPUs (2 islands x 2 ranks) vs world Gloo on CPU copies"
  start=$(date +%s)
  port=$((29600 + RANDOM % 200))
  pids=()
  for node in 0 1; do
    timeout 500 python3 -m torch.distributed.run --nnodes 2 --node-rank $node --nproc-per-node 2 --max-restarts 0 \
      --master-addr 127.0.0.1 --master-port $port bench/gpu/plugin_check.py "$out/check4" gloo > "$out/check4/node$node.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || { echo "FAILED node (rc $?)"; fail=1; }; done
  echo "  wall $(( $(date +%s) - start )) s"; summary "$out/check4"
  tail -5 "$out/check4/node0.log"
  pgrep -f 'gbbridge serve' && { echo "leftover gbbridge found"; fail=1; }
  for ex in ddp_train fsdp_train; do
    echo "== examples/$ex.py on 2 GPUs (split test), as a user launches it"
    timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 0 \
      examples/$ex.py > "$out/$ex.out" 2> "$out/$ex.log" || { echo "FAILED (rc $?)"; fail=1; }
    tail -4 "$out/$ex.log"
  done
else
  # One GPU: two torchrun "nodes" of one rank each, both on cuda:0, one
  # island each (a split test of two islands sharing the GPU and its host
  # link); the reference is a world Gloo group on CPU copies, as above.
  echo "== one GPU: split test, 2 ranks on the one GPU as two torchrun nodes (2 islands x 1 rank) vs world Gloo on CPU copies"
  for mode in auto host; do  # the GPU path's exchange-and-add (auto, >= 1 MiB) and the host reduce
    start=$(date +%s)
    d=$out/check2/$mode; mkdir -p "$d"
    GPUBRIDGE_BRIDGE_REDUCE=$mode two_nodes 300 "$d/node.log" bench/gpu/plugin_check.py "$d" gloo ||
      { echo "FAILED node, GPUBRIDGE_BRIDGE_REDUCE=$mode (rc $?)"; fail=1; }
    echo "  GPUBRIDGE_BRIDGE_REDUCE=$mode: wall $(( $(date +%s) - start )) s"; summary "$d"
    tail -3 "$d/node.log.0"
    python3 - "$d" "$mode" <<'PY' || fail=1
import glob, json, sys
rows = [json.load(open(f)) for f in glob.glob(sys.argv[1] + "/check.*.json")]
want_gpu = sys.argv[2] == "auto"  # auto: every 1 MiB+ all_reduce reduced on the GPU
bad = [r.get("rank") for r in rows if "error" in r or (r.get("exchanged", 0) > 0) != want_gpu]
if len(rows) != 2 or bad:
    sys.exit(f"  the {sys.argv[2]} run did not take the path it names on ranks {bad} ({len(rows)} results)")
PY
    pgrep -f 'gbbridge serve' && { echo "leftover gbbridge found"; fail=1; }
  done
  mkdir -p "$out/check4"
  for ex in ddp_train fsdp_train; do
    echo "== examples/$ex.py on the one GPU (split test: two nodes of one rank), as a user launches it"
    two_nodes 200 "$out/$ex.log" examples/$ex.py || { echo "FAILED $ex (rc $?)"; fail=1; }
    tail -3 "$out/$ex.log.0"
  done
fi
echo "== plugin-check done, fail=$fail"
tar czf "$out/plugin-check.tgz" -C "$out" check2 check4 && rm -rf "$out/check2" "$out/check4"
exit $fail
