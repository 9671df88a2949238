#!/usr/bin/env bash
# kit/lib/task.sh - run by srun on every task of a kit job; sets what the
# task's program needs from what kit_begin exported and Slurm's task
# variables, then execs the program.
#
#   task.sh rank CMD...      one task per rank (srun --het-group=0,1,...):
#                            RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
#                            MASTER_ADDR/PORT, GPUBRIDGE_NAMESPACE
#   task.sh node K CMD...    one task per node (or per component) of
#                            component K: KIT_NODE_RANK, KIT_NPROC
#
# Both set KIT_COMPONENT, KIT_PARTITION, KIT_VENDOR, KIT_REQUIRE, KIT_PY (the
# component's python) and, in simulation (KIT_SIMULATE=1), GPUBRIDGE_VENDOR
# and GPUBRIDGE_SIM_HOSTNAME. In CMD, the word @python is replaced by KIT_PY.
set -euo pipefail

die() {
	echo "kit task (rank ${SLURM_PROCID:-?} on ${SLURMD_NODENAME:-?}): error: $*" >&2
	exit 2
}

mode=${1:-}
shift || true
node=${SLURMD_NODENAME:-$(hostname -s)}

# index_of WORD LIST...: the position of WORD in LIST, or nothing.
index_of() {
	local w=$1 i=0 x
	shift
	for x in "$@"; do
		[ "$x" = "$w" ] && {
			echo $i
			return
		}
		i=$((i + 1))
	done
}

case $mode in
rank)
	# Slurm numbers a heterogeneous step's tasks across components in
	# component order (SLURM_PROCID): the component is the one whose ranks
	# hold this task's, and this node must be one of that component's.
	procid=${SLURM_PROCID:?not a Slurm task}
	k=""
	for ((c = 0; c < KIT_K; c++)); do
		off=KIT_OFFSET_$c n=KIT_NTASKS_$c
		if [ "$procid" -ge "${!off}" ] && [ "$procid" -lt $((${!off} + ${!n})) ]; then
			k=$c
			break
		fi
	done
	[ -n "$k" ] || die "SLURM_PROCID $procid is outside every component's ranks (world size $WORLD_SIZE)"
	;;
node)
	k=${1:?task.sh node: no component}
	shift
	;;
*)
	die "usage: task.sh rank CMD... | task.sh node K CMD... (got '$mode')"
	;;
esac

nodes_var=KIT_NODES_$k tpn_var=KIT_TPN_$k
read -r -a nodes <<<"${!nodes_var}"
read -r -a tpn <<<"${!tpn_var}"
i=$(index_of "$node" "${nodes[@]}")
[ -n "$i" ] || die "this task of component $k runs on node $node, which is not one of the component's nodes (${nodes[*]})"

v=KIT_PARTITION_$k && export KIT_PARTITION=${!v}
v=KIT_VENDOR_$k && export KIT_VENDOR=${!v}
v=KIT_REQUIRE_$k && export KIT_REQUIRE=${!v}
v=KIT_PYTHON_$k && export KIT_PY=${!v}
v=KIT_NODE_OFFSET_$k && export KIT_NODE_RANK=$((${!v} + i))
export KIT_COMPONENT=$k KIT_NPROC=${tpn[$i]}
if [ "${KIT_SIMULATE:-0}" = 1 ]; then
	# CPU simulation: this task stands in for the component's vendor, and
	# for its own node (all "nodes" may be one host).
	export GPUBRIDGE_VENDOR=$KIT_VENDOR GPUBRIDGE_SIM_HOSTNAME=$node
fi

if [ "$mode" = rank ]; then
	export RANK=$procid LOCAL_RANK=${SLURM_LOCALID:?} LOCAL_WORLD_SIZE=${tpn[$i]}
	# A fresh discovery namespace per job and per requeue: the plugin's
	# default takes the job id but not Slurm's restart count.
	export GPUBRIDGE_NAMESPACE=${GPUBRIDGE_NAMESPACE:-job-${SLURM_JOB_ID}/attempt-${SLURM_RESTART_COUNT:-0}}
	[ "$LOCAL_RANK" -lt "$LOCAL_WORLD_SIZE" ] || die "LOCAL_RANK $LOCAL_RANK is not below the node's $LOCAL_WORLD_SIZE tasks"
fi

[ $# -gt 0 ] || die "no command"
args=()
for a in "$@"; do
	if [ "$a" = @python ]; then args+=("$KIT_PY"); else args+=("$a"); fi
done
exec "${args[@]}"
