# Sourced by bench/gpu scripts: two_nodes LIMIT LOG SCRIPT ARGS... runs
# SCRIPT as two torchrun "nodes" of one rank each on this host (with one
# GPU both on cuda:0: a split test of two islands sharing it), each under
# `timeout LIMIT`, node N's output in LOG.N; the status is non-zero when a
# node failed. The caller's environment (GPUBRIDGE_*, say) reaches both.
two_nodes() {
  local lim=$1 log=$2; shift 2
  local port=$((29600 + RANDOM % 300)) pids=() rc=0 node p
  for node in 0 1; do
    GPUBRIDGE_BIN_DIR=${GPUBRIDGE_BIN_DIR:-$PWD/bin} PYTHONPATH=${PYTHONPATH:-$PWD/torchplugin} \
      OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} timeout "$lim" \
      python3 -m torch.distributed.run --nnodes 2 --node-rank $node --nproc-per-node 1 --max-restarts 0 \
      --master-addr 127.0.0.1 --master-port $port "$@" > "$log.$node" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  return $rc
}
