# kit/lib/kit.sh - what the kit's sbatch scripts share (sourced, bash).
#
# A kit job is a Slurm heterogeneous job with one component per vendor, in
# rank order (component 0's tasks are ranks 0.., then component 1's, ...).
# kit_begin, in the batch script (which Slurm runs on component 0's first
# node), reads site.env and Slurm's SLURM_*_HET_GROUP_<k> variables and
# exports what every task needs; lib/task.sh, run by srun on every task,
# turns that into RANK, WORLD_SIZE, LOCAL_RANK and the component's settings.
#
# Verdicts: every step ends with one line on stdout,
#   kit step N NAME: PASS|FAIL|ERROR|NOT RUN: reason
# the same as the last JSON line of its rows (schema gpubridge.kit-verdict/v1),
# and exits with:
KIT_PASS=0    # every check held
KIT_FAIL=1    # a check failed: the cluster is not ready (the reason says where)
KIT_ERROR=2   # the step could not run as configured (site.env, tools, a crash, a timeout)
KIT_NOTRUN=77 # the step does not apply here (a GPU step in CPU simulation; no step 5 trace for step 6)

kit_die() { # kit_die MESSAGE: a configuration or usage error: the step's ERROR verdict (exit 2)
	echo "kit: error: $*" >&2
	[ -n "${KIT_STEP:-}" ] && kit_verdict ERROR "$*"
	exit $KIT_ERROR
}

# kit_load_config: site.env (KIT_CONFIG names another file), checked.
kit_load_config() {
	local cfg=${KIT_CONFIG:-$KIT_DIR/site.env}
	[ -f "$cfg" ] || kit_die "no configuration: $cfg is missing (copy site.env.example to site.env and edit it)"
	# shellcheck disable=SC1090
	. "$cfg"
	local n=${#KIT_PARTITIONS[@]} a
	[ "$n" -ge 1 ] || kit_die "$cfg: KIT_PARTITIONS is empty"
	for a in KIT_VENDORS KIT_NODES KIT_GPUS_PER_NODE KIT_REQUIRE KIT_PYTHON; do
		local -n arr=$a
		[ "${#arr[@]}" -eq "$n" ] || kit_die "$cfg: $a has ${#arr[@]} entries, KIT_PARTITIONS has $n (one per component)"
	done
	local v
	for v in "${KIT_VENDORS[@]}"; do
		case $v in nvidia | amd) ;; *) kit_die "$cfg: KIT_VENDORS: '$v' is not nvidia or amd" ;; esac
	done
	KIT_OUT=${KIT_OUT:-$KIT_DIR/out}
	KIT_SIMULATE=${KIT_SIMULATE:-0}
}

# kit_expand_counts "2(x3),1": one count per node, "2 2 2 1" (Slurm's
# SLURM_TASKS_PER_NODE form).
kit_expand_counts() {
	local part parts out=() i
	IFS=, read -r -a parts <<<"$1"
	for part in "${parts[@]}"; do
		if [[ $part =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then
			for ((i = 0; i < BASH_REMATCH[2]; i++)); do out+=("${BASH_REMATCH[1]}"); done
		else
			out+=("$part")
		fi
	done
	echo "${out[*]}"
}

# kit_begin STEP NAME: config, layout, the step's output directory, and the
# exports every task reads:
#   KIT_K (components), KIT_PARTITION_k, KIT_VENDOR_k, KIT_REQUIRE_k,
#   KIT_PYTHON_k, KIT_NODES_k (node names), KIT_TPN_k (tasks per node, in
#   the same order), KIT_NTASKS_k, KIT_OFFSET_k (first rank), KIT_NODE_OFFSET_k,
#   KIT_NNODES, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, KIT_STEP_DIR.
kit_begin() {
	KIT_STEP=$1
	KIT_STEP_NAME=$2
	KIT_T0=$SECONDS
	[ -n "${SLURM_JOB_ID:-}" ] || kit_die "run this script with sbatch (no SLURM_JOB_ID)"
	export KIT_DIR
	kit_load_config
	local K=${SLURM_HET_SIZE:-}
	[ -n "$K" ] || kit_die "job $SLURM_JOB_ID is not a heterogeneous job: the script's header needs one '#SBATCH hetjob' component per vendor (run kit/configure)"
	[ "$K" -eq "${#KIT_PARTITIONS[@]}" ] || kit_die "job $SLURM_JOB_ID has $K components, site.env names ${#KIT_PARTITIONS[@]} partitions: run kit/configure after editing site.env"
	export KIT_K=$K KIT_SIMULATE
	local k rank=0 node_rank=0 nodes tpn cnt part
	for ((k = 0; k < K; k++)); do
		local nl_var=SLURM_JOB_NODELIST_HET_GROUP_$k tpn_var=SLURM_TASKS_PER_NODE_HET_GROUP_$k part_var=SLURM_JOB_PARTITION_HET_GROUP_$k
		[ -n "${!nl_var:-}" ] || kit_die "$nl_var is not set: not inside the heterogeneous job's batch script?"
		part=${!part_var:-}
		[ "$part" = "${KIT_PARTITIONS[$k]}" ] || kit_die "component $k runs in partition '$part', site.env says '${KIT_PARTITIONS[$k]}': run kit/configure after editing site.env"
		nodes=$(scontrol show hostnames "${!nl_var}" | tr '\n' ' ')
		nodes=${nodes% }
		tpn=$(kit_expand_counts "${!tpn_var:-}")
		[ "$(wc -w <<<"$nodes")" -eq "$(wc -w <<<"$tpn")" ] || kit_die "component $k: $nl_var=${!nl_var} and $tpn_var=${!tpn_var:-} disagree"
		cnt=0
		for t in $tpn; do cnt=$((cnt + t)); done
		export "KIT_PARTITION_$k=$part" "KIT_VENDOR_$k=${KIT_VENDORS[$k]}" "KIT_REQUIRE_$k=${KIT_REQUIRE[$k]}" \
			"KIT_PYTHON_$k=${KIT_PYTHON[$k]}" "KIT_NODES_$k=$nodes" "KIT_TPN_$k=$tpn" "KIT_NTASKS_$k=$cnt" \
			"KIT_OFFSET_$k=$rank" "KIT_NODE_OFFSET_$k=$node_rank"
		rank=$((rank + cnt))
		node_rank=$((node_rank + $(wc -w <<<"$nodes")))
	done
	export WORLD_SIZE=$rank KIT_NNODES=$node_rank
	# The store lives on component 0's first node (where this script runs):
	# its address as Slurm reaches it, and a port per job and attempt, so that
	# two kit jobs sharing a node, or a requeued job and what is left of its
	# earlier attempt, do not collide (KIT_MASTER_PORT overrides).
	local first=${KIT_NODES_0%% *} addr
	addr=$(scontrol show node -o "$first" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
	export MASTER_ADDR=${addr:-$first}
	export MASTER_PORT=${KIT_MASTER_PORT:-$((20000 + (SLURM_JOB_ID * 7 + ${SLURM_RESTART_COUNT:-0}) % 12000))}
	KIT_STEP_DIR=$KIT_OUT/step$KIT_STEP-$KIT_STEP_NAME-$SLURM_JOB_ID
	[ "$KIT_STEP" = launch ] && KIT_STEP_DIR=$KIT_OUT/launch-$KIT_STEP_NAME-$SLURM_JOB_ID
	mkdir -p "$KIT_STEP_DIR" || kit_die "cannot create $KIT_STEP_DIR (KIT_OUT must be writable, on a file system the login node sees)"
	export KIT_STEP_DIR KIT_OUT KIT_STEP KIT_STEP_NAME
	KIT_ROWS=$KIT_STEP_DIR/rows.jsonl
	# A requeued job (the same job id) keeps its earlier attempt's rows aside.
	[ -s "$KIT_ROWS" ] && mv "$KIT_ROWS" "$KIT_STEP_DIR/rows.before-restart-${SLURM_RESTART_COUNT:-0}.jsonl"
	: >"$KIT_ROWS"
	kit_layout_row >>"$KIT_ROWS"
	echo "kit step $KIT_STEP $KIT_STEP_NAME: job $SLURM_JOB_ID${SLURM_RESTART_COUNT:+ (restart $SLURM_RESTART_COUNT)}, $K components, $WORLD_SIZE ranks on $KIT_NNODES nodes; store $MASTER_ADDR:$MASTER_PORT; output $KIT_STEP_DIR" >&2
}

# kit_json_str STRING: STRING as a JSON string.
kit_json_str() {
	local s=$1
	s=${s//\\/\\\\}
	s=${s//\"/\\\"}
	s=${s//$'\n'/\\n}
	s=${s//$'\t'/\\t}
	s=${s//$'\r'/}
	printf '"%s"' "$s"
}

# kit_step_json: the step as JSON: its number, or "launch".
kit_step_json() {
	if [[ $KIT_STEP =~ ^[0-9]+$ ]]; then echo "$KIT_STEP"; else kit_json_str "$KIT_STEP"; fi
}

# kit_layout_row: the job's layout as one JSON line (schema gpubridge.kit-layout/v1).
kit_layout_row() {
	local k comps="" sep=""
	for ((k = 0; k < KIT_K; k++)); do
		local p=KIT_PARTITION_$k v=KIT_VENDOR_$k n=KIT_NODES_$k t=KIT_TPN_$k c=KIT_NTASKS_$k o=KIT_OFFSET_$k r=KIT_REQUIRE_$k
		local nodes_json="" ns=""
		for x in ${!n}; do
			nodes_json+="$ns$(kit_json_str "$x")"
			ns=,
		done
		comps+="$sep{\"component\":$k,\"partition\":$(kit_json_str "${!p}"),\"vendor\":\"${!v}\",\"nodes\":[$nodes_json],\"tasks_per_node\":[${!t// /,}],\"ranks\":[${!o},$((${!o} + ${!c} - 1))],\"require\":$(kit_json_str "${!r}")}"
		sep=,
	done
	printf '{"schema":"gpubridge.kit-layout/v1","step":%s,"name":%s,"job":%s,"restart":%s,"simulated":%s,"world_size":%s,"master":%s,"components":[%s]}\n' \
		"$(kit_step_json)" "$(kit_json_str "$KIT_STEP_NAME")" "$SLURM_JOB_ID" "${SLURM_RESTART_COUNT:-0}" \
		"$([ "$KIT_SIMULATE" = 1 ] && echo true || echo false)" "$WORLD_SIZE" "$(kit_json_str "$MASTER_ADDR:$MASTER_PORT")" "$comps"
}

# kit_verdict RESULT REASON: the step's verdict: the last JSON line of its
# rows, verdict.txt, one line on stdout; exits with RESULT's code.
kit_verdict() {
	local result=$1 reason=$2 code
	case $result in
	PASS) code=$KIT_PASS ;;
	FAIL) code=$KIT_FAIL ;;
	ERROR) code=$KIT_ERROR ;;
	"NOT RUN") code=$KIT_NOTRUN ;;
	*) kit_die "kit_verdict: bad result '$result'" ;;
	esac
	local line="kit step $KIT_STEP $KIT_STEP_NAME: $result: $reason"
	if [ -n "${KIT_ROWS:-}" ]; then
		printf '{"schema":"gpubridge.kit-verdict/v1","step":%s,"name":%s,"job":%s,"result":"%s","exit":%d,"reason":%s,"simulated":%s,"seconds":%d}\n' \
			"$(kit_step_json)" "$(kit_json_str "$KIT_STEP_NAME")" "$SLURM_JOB_ID" "$result" "$code" \
			"$(kit_json_str "$reason")" "$([ "${KIT_SIMULATE:-0}" = 1 ] && echo true || echo false)" \
			$((SECONDS - KIT_T0)) >>"$KIT_ROWS"
		echo "$line" >"$KIT_STEP_DIR/verdict.txt"
	fi
	echo "$line"
	exit "$code"
}

# kit_srun_per_rank CMD...: srun over every component, one task per rank
# (the allocation's tasks), each through lib/task.sh. Once a task has ended,
# the others get KIT_SRUN_WAIT seconds (default 120) before srun stops them:
# ranks that fail together all report why, and a crashed rank cannot leave
# the rest waiting for the group's timeout.
kit_srun_per_rank() {
	local hg
	hg=$(seq -s, 0 $((KIT_K - 1)))
	srun --het-group="$hg" --kill-on-bad-exit=0 --wait="${KIT_SRUN_WAIT:-120}" "$KIT_DIR/lib/task.sh" rank "$@"
}

# kit_srun_per_node [--kill] CMD...: srun over every component, one task per
# node; --kill: one task failing stops the others (srun --kill-on-bad-exit).
kit_srun_per_node() {
	local k args=() n kill=0
	[ "${1:-}" = --kill ] && kill=1 && shift
	for ((k = 0; k < KIT_K; k++)); do
		n=$(wc -w <<<"$(eval echo "\$KIT_NODES_$k")")
		[ "$k" -gt 0 ] && args+=(:)
		args+=(--het-group="$k" --nodes="$n" --ntasks="$n" --ntasks-per-node=1 "$KIT_DIR/lib/task.sh" node "$k" "$@")
	done
	srun --kill-on-bad-exit=$kill "${args[@]}"
}

# kit_srun_per_component CMD...: srun over every component, one task on its
# first node (the island's leader node). A member that fails does not stop
# the others: each reports its own outcome.
kit_srun_per_component() {
	local k args=()
	for ((k = 0; k < KIT_K; k++)); do
		[ "$k" -gt 0 ] && args+=(:)
		args+=(--het-group="$k" --nodes=1 --ntasks=1 "$KIT_DIR/lib/task.sh" node "$k" "$@")
	done
	srun --kill-on-bad-exit=0 "${args[@]}"
}

# kit_python: component 0's python (the batch script runs on its first node).
kit_python() { echo "$KIT_PYTHON_0"; }

# kit_tool NAME: the path of a gpubridge tool on this node: GPUBRIDGE_BIN_DIR,
# else the tools of component 0's gpubridge, else PATH; fails when none.
kit_tool() {
	local d
	if [ -n "${GPUBRIDGE_BIN_DIR:-}" ] && [ -x "$GPUBRIDGE_BIN_DIR/$1" ]; then
		echo "$GPUBRIDGE_BIN_DIR/$1"
		return
	fi
	d=$("$(kit_python)" -m gpubridge --tools-dir 2>/dev/null) && [ -x "$d/$1" ] && {
		echo "$d/$1"
		return
	}
	command -v "$1"
}

# kit_judge NAME RC: the verdict from the step's rows (py/judge.py), and exit.
kit_judge() {
	local out result reason
	out=$("$(kit_python)" "$KIT_DIR/py/judge.py" "$1" "$KIT_ROWS" "$2" 2>&1) ||
		kit_verdict ERROR "py/judge.py failed with $(kit_python): $out"
	result=${out%%$'\t'*}
	reason=${out#*$'\t'}
	kit_verdict "$result" "$reason"
}

# kit_stderr: where the tasks' stderr goes: the job's output and the step's
# stderr.log.
kit_stderr() { echo "$KIT_STEP_DIR/stderr.log"; }
