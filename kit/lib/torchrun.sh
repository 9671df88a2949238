#!/usr/bin/env bash
# kit/lib/torchrun.sh SCRIPT [ARGS...]: one node's torchrun in a kit job,
# run through lib/task.sh node K (which set KIT_PY, KIT_NNODES,
# KIT_NODE_RANK, KIT_NPROC and, in simulation, GPUBRIDGE_VENDOR). Static
# rendezvous: node ranks follow the components' order, so the global ranks
# of each component (each vendor) form one contiguous block.
set -euo pipefail
# torchrun names the run (TORCHELASTIC_RUN_ID, gpubridge's namespace) after
# --rdzv-id; a namespace set by hand would be reused by torchrun's restarts.
unset GPUBRIDGE_NAMESPACE
exec "$KIT_PY" -m torch.distributed.run \
	--nnodes="$KIT_NNODES" --node-rank="$KIT_NODE_RANK" --nproc-per-node="$KIT_NPROC" \
	--master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \
	--rdzv-id="slurm-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}" --max-restarts=0 \
	"$@"
