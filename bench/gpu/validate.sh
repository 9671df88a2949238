#!/usr/bin/env bash
# One GPU-host session of checks and benchmarks, from the repository root:
#   bash bench/gpu/validate.sh STEP...      (default: every step)
# STEP: plugin-check exchange host-bridge profile (issue 12: CPU profiles and
# Go execution traces of gbbridge bench, bench/gpu/profile-bench.sh) codec trace rebalance overhead
# codec-compile compress compress-train (issue 13: the torch codec eager and
# compiled; the GPU path against gbbridge's bit for bit and each codec's
# all_reduce time; training exact, fp8 with and without error feedback;
# GB_COMPRESS_ARGS and GB_TRAIN_ARGS add arguments to their workers)
# one-gpu-bench (plugin_bench.py and plugin_train.py as two torchrun nodes of
# one rank on GPU 0: every call's check and the parameters' digests on a GPU)
# p2p (issue 16: p2p_bench.py as two torchrun nodes of one rank, 1 MiB
# to 1 GiB send/recv across the islands against the bridged all_reduce's algbw, every
# byte checked) pipeline (issue 16: pipeline-bench.sh, tokens/s of the
# 2-stage pipeline example over gpubridge against NCCL, GPipe and 1F1B)
# latency (issue 16: the 4-byte all_reduce of 4 CPU ranks, flat and
# reduce-bridge-broadcast against Gloo, for each GPUBRIDGE_SPIN_US in
# GB_SPINS (default "- 50 200 1000"; -: unset); and BenchmarkServeLatency (the
# plugin's Python feed client timed beside the Go one)
# when gbtest/gbbridge.test was built and carried:
# go test -c -o gbtest/gbbridge.test ./tools/gbbridge; then one traced
# run whose phase medians bench/trace_phases.py writes to latency-phases.json;
# then bench/plugin_cpu.py under flat: the plugin's own CPU per call, split
# around the feed request, into plugin-cpu.jsonl).
# Each step runs one of bench/gpu's scripts under `timeout` (its share of
# GB_BUDGET_S, default 540 s, so a session fits a 10-minute device call) with
# its output in $OUT/STEP/, packed into $OUT/STEP.tgz afterwards; the files
# that come back are those archives, validate.log (every step's output) and
# validate.jsonl (one row per step: name, exit status, seconds; schema
# gpubridge.validate/v1). Exit status: 0 when every step passed, 1 when one
# failed or ran out of time, 2 on a usage error.
# Needs bin/ built on the dev machine and carried, torch with CUDA.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpubridge-out}; mkdir -p "$out"
exec > >(tee -a "$out/validate.log") 2>&1
# Pass GB_COMMIT: the device machine's copy may carry another HEAD than the tree it got.
GB_COMMIT=${GB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}; export GB_COMMIT
all=(plugin-check exchange host-bridge profile codec trace rebalance overhead one-gpu-bench codec-compile compress compress-train p2p pipeline latency)
steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=("${all[@]}")
declare -A share=([plugin-check]=120 [exchange]=150 [host-bridge]=330 [profile]=100 [codec]=120 [trace]=120 [rebalance]=150 [overhead]=90 [one-gpu-bench]=200 [codec-compile]=150 [compress]=160 [compress-train]=280 [p2p]=160 [pipeline]=240 [latency]=240)
for s in "${steps[@]}"; do [ -n "${share[$s]:-}" ] || { echo "unknown step $s (steps: ${all[*]})"; exit 2; }; done
budget=${GB_BUDGET_S:-540}; t_end=$(( $(date +%s) + budget ))
echo "== $(date -u +%FT%TZ) validate: commit $GB_COMMIT; steps ${steps[*]}; $(nproc --all) cores"
nvidia-smi -L 2>/dev/null || echo "(no nvidia-smi)"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "nccl", torch.cuda.nccl.version())'
. bench/gpu/two_nodes.sh
fail=0
for s in "${steps[@]}"; do
  left=$(( t_end - $(date +%s) ))
  lim=${share[$s]}; [ "$lim" -le "$left" ] || lim=$left
  d=$out/$s; mkdir -p "$d"
  echo "== step $s (limit ${lim} s)"
  start=$(date +%s)
  if [ "$lim" -le 5 ]; then
    rc=124; echo "  no time left"
  else
    case $s in
      plugin-check) OUT=$d timeout "$lim" bash bench/gpu/plugin-check.sh ;;
      exchange) OUT=$d GB_LIMIT_S=$(( lim - 10 )) timeout "$lim" bash bench/gpu/exchange-bench.sh ;;
      host-bridge) OUT=$d GB_ITERS=${GB_ITERS:-3} timeout "$lim" bash bench/gpu/host-bridge-bench.sh ;;
      profile) OUT=$d timeout "$lim" bash bench/gpu/profile-bench.sh ;;
      codec) PYTHONPATH=$PWD/torchplugin timeout "$lim" python3 bench/gpu/codec_check.py "$d" ;;
      trace) OUT=$d timeout "$lim" bash bench/gpu/trace-check.sh ;;
      rebalance) OUT=$d timeout "$lim" bash bench/gpu/rebalance.sh ;;
      overhead)
        GPUBRIDGE_BIN_DIR=$PWD/bin PYTHONPATH=$PWD/torchplugin OMP_NUM_THREADS=1 timeout "$lim" \
          python3 -m torch.distributed.run --standalone --nproc-per-node 4 --max-restarts 0 \
          bench/gpu/plugin_overhead.py "$d/overhead.jsonl" --check-calls --rounds 6 --iters 1000 ;;
      codec-compile)
        PYTHONPATH=$PWD/torchplugin timeout "$lim" python3 bench/gpu/codec_compile.py "$d/codec-compile.jsonl" --values $((64 << 20)) ;;
      compress)
        read -r -a extra <<< "${GB_COMPRESS_ARGS:-}"
        two_nodes "$lim" "$d/compress.log" bench/gpu/compress_bench.py "$d/compress.jsonl" "${extra[@]}"
        rc=$?; tail -n 8 "$d/compress.log.0"; [ "$rc" -eq 0 ] ;;
      compress-train)
        read -r -a extra <<< "${GB_TRAIN_ARGS:-}"
        two_nodes "$lim" "$d/train.log" bench/gpu/compress_train.py "$d/compress-train.jsonl" "${extra[@]}"
        rc=$?; tail -n 8 "$d/train.log.0"; [ "$rc" -eq 0 ] ;;
      p2p)
        two_nodes "$lim" "$d/p2p.log" bench/gpu/p2p_bench.py --sizes 1M,64M,256M,1G --iters 6
        rc=$?; grep '^{' "$d/p2p.log.0" > "$d/p2p.jsonl"; grep -v '^{' "$d/p2p.log.0" | tail -n 8; [ "$rc" -eq 0 ] ;;
      pipeline) OUT=$d GB_LIMIT_S=$(( (lim - 10) / 4 )) timeout "$lim" bash bench/gpu/pipeline-bench.sh ;;
      latency)
        rc=0
        if [ -x gbtest/gbbridge.test ]; then
          GPUBRIDGE_BIN=$PWD/bin GPUBRIDGE_PYTHON=python3 timeout 90 gbtest/gbbridge.test -test.run '^$' -test.bench BenchmarkServeLatency \
            -test.benchtime 1x > "$d/serve-latency.txt" 2>&1 || rc=1
          grep -E 'Benchmark|python|ok|FAIL' "$d/serve-latency.txt" | tail -n 5
        fi
        read -r -a spins <<< "${GB_SPINS:-- 50 200 1000}"
        per=$(( (lim - 110) / ${#spins[@]} ))
        for sp in "${spins[@]}"; do
          ( [ "$sp" = - ] || export GPUBRIDGE_SPIN_US=$sp
            GPUBRIDGE_BIN_DIR=$PWD/bin PYTHONPATH=$PWD/torchplugin OMP_NUM_THREADS=1 timeout "$per" \
              python3 -m torch.distributed.run --standalone --nproc-per-node 4 --max-restarts 0 \
              bench/gpu/plugin_overhead.py "$d/latency.jsonl" --policies flat,reduce-bridge-broadcast \
              --rounds 4 --iters 500 > "$d/latency-$sp.log" 2>&1 ) || rc=1
          echo "  spin $sp: $(tail -n 1 "$d/latency.jsonl" | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print("gloo %.0f us, flat %.2fx p99 %.2fx, rbb %.2fx" % (r["gloo"]["median_us"], r["policy:flat:ratio_median"], r["policy:flat:ratio_p99"], r["policy:reduce-bridge-broadcast:ratio_median"]))' 2>&1)"
        done
        # One traced run (spin as the defaults pick): where a call's time goes.
        GPUBRIDGE_TRACE=$d/trace GPUBRIDGE_BIN_DIR=$PWD/bin PYTHONPATH=$PWD/torchplugin OMP_NUM_THREADS=1 timeout 60 \
          python3 -m torch.distributed.run --standalone --nproc-per-node 4 --max-restarts 0 \
          bench/gpu/plugin_overhead.py "$d/traced.jsonl" --rounds 2 --iters 500 > "$d/traced.log" 2>&1 || rc=1
        python3 bench/trace_phases.py "$d/trace/rank-0.jsonl" | tee "$out/latency-phases.json" || rc=1
        # The same flat call with every serve's Go execution trace (GPUBRIDGE_GOTRACE,
        # read with go tool trace on the dev machine): where the legs to and from serve wait.
        mkdir -p "$d/gotrace"
        GPUBRIDGE_GOTRACE=$d/gotrace/serve GPUBRIDGE_POLICY=flat GPUBRIDGE_BIN_DIR=$PWD/bin PYTHONPATH=$PWD/torchplugin OMP_NUM_THREADS=1 timeout 40 \
          python3 -m torch.distributed.run --standalone --nproc-per-node 4 --max-restarts 0 \
          bench/gpu/plugin_overhead.py "$d/gotraced.jsonl" --rounds 1 --iters 500 > "$d/gotraced.log" 2>&1 || rc=1
        # The plugin's own CPU per call (flat, spin as the defaults pick): what a call costs around the feed.
        GPUBRIDGE_POLICY=flat GPUBRIDGE_BIN_DIR=$PWD/bin PYTHONPATH=$PWD/torchplugin OMP_NUM_THREADS=1 timeout 40 \
          python3 -m torch.distributed.run --standalone --nproc-per-node 4 --max-restarts 0 \
          bench/plugin_cpu.py "$d/plugin-cpu.jsonl" --rounds 3 > "$d/plugin-cpu.log" 2>&1 || rc=1
        tail -n 1 "$d/plugin-cpu.jsonl" 2>/dev/null | tee "$out/plugin-cpu.jsonl"
        cp "$d/latency.jsonl" "$out/latency.jsonl" 2>/dev/null
        [ "$rc" -eq 0 ] ;;
      one-gpu-bench)
        rc=0
        two_nodes 80 "$d/bench-gpubridge.log" bench/gpu/plugin_bench.py gpubridge "$d/bench.jsonl" --sizes 1M,256M,1G --iters 10 || rc=1
        tail -n 4 "$d/bench-gpubridge.log.0"
        two_nodes 80 "$d/bench-gloo-bridge.log" bench/gpu/plugin_bench.py gloo-bridge "$d/bench.jsonl" --sizes 1M,256M,1G --iters 5 || rc=1
        tail -n 4 "$d/bench-gloo-bridge.log.0"
        two_nodes 100 "$d/train.log" bench/gpu/plugin_train.py gpubridge "$d/train.jsonl" --steps 20 || rc=1
        tail -n 4 "$d/train.log.0"
        [ "$rc" -eq 0 ] ;;
    esac
    rc=$?
  fi
  secs=$(( $(date +%s) - start ))
  echo "== step $s: rc $rc, ${secs} s"
  [ "$rc" -eq 0 ] || fail=1
  printf '{"schema":"gpubridge.validate/v1","commit":"%s","step":"%s","rc":%d,"seconds":%d}\n' \
    "$GB_COMMIT" "$s" "$rc" "$secs" >> "$out/validate.jsonl"
  pkill -f 'gbbridge serve' 2>/dev/null && echo "  (a gbbridge serve was left running after $s)"
  tar czf "$out/$s.tgz" -C "$out" "$s" && rm -rf "$d"
done
echo "== validate done: fail=$fail"
exit $fail
