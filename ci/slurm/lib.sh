# ci/slurm/lib.sh - what the real-Slurm tests share, sourced (not run):
# install slurm-wlm and munge, a private cluster in a temporary directory (own
# munged, own slurm.conf through SLURM_CONF, own ports), daemons stopped by
# PID whatever happens, and waits with scaled deadlines.
#
#   SLURM_TEST_NAME="slurm prolog test"; . ci/slurm/lib.sh
#   slurm_need_root "why"; slurm_install; slurm_init gbprobe-slurm
#   slurm_write_conf "NodeName=... " "PartitionName=..."   # the cluster's own lines
#   slurm_start; slurm_wait_idle "$HOST"
#
# Deadlines are for hangs: every one goes through slurm_scale, so
# GPUBRIDGE_TEST_TIMEOUT_SCALE=3 (the knob of the Go and Python tests)
# stretches them on a slow or loaded machine.

SKIP=77
SLURM_TEST_NAME=${SLURM_TEST_NAME:-slurm test}

say() { printf '%s: %s\n' "$SLURM_TEST_NAME" "$*" >&2; }

# A check's outcome, counted for the test's last line.
passed=0
failed=0
pass() {
	say "PASS: $*"
	passed=$((passed + 1))
}
fail() {
	say "FAIL: $*"
	failed=$((failed + 1))
}
skip() {
	say "SKIPPED (exit $SKIP): $*"
	exit $SKIP
}

# slurm_scale SECONDS: SECONDS times GPUBRIDGE_TEST_TIMEOUT_SCALE (at least
# 1; a value that is not a number counts as 1), rounded up.
slurm_scale() {
	awk -v s="$1" -v f="${GPUBRIDGE_TEST_TIMEOUT_SCALE:-1}" \
		'BEGIN { if (f !~ /^[0-9]+(\.[0-9]*)?$/ || f + 0 < 1) f = 1; v = s * f; i = int(v); if (i < v) i++; print i }'
}

slurm_need_root() {
	[ "$(id -u)" -eq 0 ] || skip "needs root ($*)"
}

slurm_install() {
	if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
		say "installing slurm-wlm and munge (apt-get)"
		export DEBIAN_FRONTEND=noninteractive
		if ! apt-get -y -q install slurm-wlm munge >/tmp/gbprobe-slurm-apt.log 2>&1; then
			apt-get -q update >>/tmp/gbprobe-slurm-apt.log 2>&1 || true
			apt-get -y -q install slurm-wlm munge >>/tmp/gbprobe-slurm-apt.log 2>&1 ||
				skip "apt-get install slurm-wlm munge failed; see /tmp/gbprobe-slurm-apt.log: $(tail -n 3 /tmp/gbprobe-slurm-apt.log | tr '\n' ' ')"
		fi
	fi
	local c
	for c in slurmctld slurmd munged munge srun sbatch scontrol sinfo squeue timeout; do
		command -v $c >/dev/null || skip "$c not found after installing slurm-wlm and munge"
	done
}

show_logs() {
	local f
	for f in "$WORK"/log/*; do
		[ -s "$f" ] || continue
		echo "----- $f (last 25 lines)" >&2
		tail -n 25 "$f" >&2
	done
}

# slurm_cleanup runs at EXIT: it stops the daemons in reverse start order
# (TERM, then KILL after 5 s), shows the logs when the test failed, and
# removes the work directory unless KEEP_SLURM_TEST is set.
slurm_cleanup() {
	local rc=$?
	local i
	if [ -n "${SLURMCTLD_PID:-}" ] && kill -0 "$SLURMCTLD_PID" 2>/dev/null; then
		# A job still running would outlive slurmd (slurmstepd is not its
		# child): cancel every job, and wait (bounded) until none is left.
		timeout 10 scancel --quiet --user=root 2>/dev/null || true
		local deadline=$((SECONDS + $(slurm_scale 30)))
		while [ "$SECONDS" -lt "$deadline" ] && [ -n "$(timeout 10 squeue -h -o %i 2>/dev/null || echo ?)" ]; do
			sleep 0.2
		done
	fi
	for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
		kill -TERM "${PIDS[$i]}" 2>/dev/null || true
	done
	for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
		for _ in $(seq 50); do
			kill -0 "${PIDS[$i]}" 2>/dev/null || break
			sleep 0.1
		done
		if kill -0 "${PIDS[$i]}" 2>/dev/null; then
			kill -KILL "${PIDS[$i]}" 2>/dev/null || true
		fi
		wait "${PIDS[$i]}" 2>/dev/null || true
	done
	if [ "$rc" -ne 0 ] && [ "$rc" -ne "$SKIP" ] && [ -n "${WORK:-}" ]; then
		show_logs
	fi
	if [ -n "${WORK:-}" ]; then
		if [ -n "${KEEP_SLURM_TEST:-}" ]; then
			say "kept $WORK"
		else
			rm -rf "$WORK"
		fi
	fi
	exit "$rc"
}

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# slurm_init PREFIX: the work directory /tmp/PREFIX.XXXXXX (WORK), SLURM_CONF,
# HOST, free ports from PORT on (a pair, or SLURM_TEST_PORTS of them), the
# munge key, the EXIT trap.
slurm_init() {
	WORK=$(mktemp -d "/tmp/$1.XXXXXX")
	chmod 755 "$WORK"
	mkdir -p "$WORK/etc" "$WORK/munge-key" "$WORK/munge" "$WORK/state" "$WORK/spool" "$WORK/log"
	chmod 700 "$WORK/munge-key"
	chmod 755 "$WORK/munge"
	export SLURM_CONF=$WORK/etc/slurm.conf
	HOST=$(hostname -s)
	PIDS=()
	trap slurm_cleanup EXIT
	trap 'exit 130' INT TERM

	# PORT (slurmctld), PORT+1 (slurmd), and SLURM_TEST_PORTS-2 more for
	# slurmds of further node names: all free.
	local n=${SLURM_TEST_PORTS:-2} i ok
	PORT=${SLURM_TEST_PORT:-16817}
	for _ in $(seq 20); do
		ok=1
		for ((i = 0; i < n; i++)); do port_free $((PORT + i)) || ok=0; done
		[ "$ok" = 1 ] && break
		PORT=$((PORT + n))
	done
	[ "$ok" = 1 ] || skip "no $n free ports in a row near ${SLURM_TEST_PORT:-16817}"

	dd if=/dev/urandom of="$WORK/munge-key/munge.key" bs=1024 count=1 status=none
	chmod 400 "$WORK/munge-key/munge.key"
}

# slurm_write_conf LINE...: slurm.conf (the settings every test shares, then
# the given lines: nodes, partitions, Prolog) and cgroup.conf.
# SLURM_TEST_SCHEDULER picks SchedulerType (default sched/builtin; a
# heterogeneous job needs sched/backfill, the only one that starts them).
# SLURM_TEST_CRED_EXPIRE sets the job credentials' lifetime (Slurm's default
# 120 s), which is also how long a requeued job waits before it starts again.
slurm_write_conf() {
	cat >"$SLURM_CONF" <<EOF
ClusterName=gbslurmtest
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
AuthType=auth/munge
AuthInfo=socket=$WORK/munge/munge.socket${SLURM_TEST_CRED_EXPIRE:+,cred_expire=$SLURM_TEST_CRED_EXPIRE}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool/%n
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.%n.pid
SlurmctldLogFile=$WORK/log/slurmctld.log
SlurmdLogFile=$WORK/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=${SLURM_TEST_SCHEDULER:-sched/builtin}
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
EOF
	printf '%s\n' "$@" >>"$SLURM_CONF"
	# CgroupPlugin=disabled makes this slurmd refuse to start; cgroup/v1 works
	# (ProctrackType and TaskPlugin above do not use it).
	echo "CgroupPlugin=cgroup/v1" >"$WORK/etc/cgroup.conf"
}

# slurm_start [NODE...]: munged, slurmctld and one slurmd per NODE (default
# HOST), as children of the test (stopped by slurm_cleanup). Several node
# names on one host need their own NodeHostname and Port in slurm.conf (a
# slurmd without --enable-multiple-slurmd refuses a NodeHostname twice).
slurm_start() {
	munged -F --force --key-file="$WORK/munge-key/munge.key" --socket="$WORK/munge/munge.socket" \
		--pid-file="$WORK/munge/munged.pid" --log-file="$WORK/log/munged.log" \
		--seed-file="$WORK/munge/munged.seed" >"$WORK/log/munged.out" 2>&1 &
	PIDS+=($!)
	local n
	n=$(($(slurm_scale 10) * 10))
	for _ in $(seq "$n"); do
		[ -S "$WORK/munge/munge.socket" ] && break
		sleep 0.1
	done
	munge -s gbprobe -S "$WORK/munge/munge.socket" | unmunge -S "$WORK/munge/munge.socket" >/dev/null 2>&1 ||
		skip "munged did not come up: $(tail -n 3 "$WORK/log/munged.out" "$WORK/log/munged.log" 2>/dev/null | tr '\n' ' ')"

	slurmctld -D -i >"$WORK/log/slurmctld.out" 2>&1 &
	SLURMCTLD_PID=$!
	PIDS+=($!)
	local node
	for node in "${@:-$HOST}"; do
		mkdir -p "$WORK/spool/$node"
		slurmd -D -N "$node" >"$WORK/log/slurmd.$node.out" 2>&1 &
		PIDS+=($!)
	done
}

node_state() { timeout 10 sinfo -h -n "$1" -o %T 2>/dev/null | head -n 1 || true; }
node_reason() { timeout 10 scontrol show node "$1" 2>/dev/null | sed -n 's/^ *Reason=//p' || true; }

# wait_state NODE REGEX SECONDS: wait (SECONDS scaled) until NODE's state
# matches REGEX.
wait_state() {
	local s=""
	local deadline=$((SECONDS + $(slurm_scale "$3")))
	while [ "$SECONDS" -lt "$deadline" ]; do
		s=$(node_state "$1")
		[[ $s =~ $2 ]] && return 0
		sleep 0.2
	done
	say "node $1 state is '$s', want /$2/"
	return 1
}

# slurm_wait_idle NODE: the cluster is up when NODE is idle; else skip
# (Slurm cannot run here), with the daemons' logs.
slurm_wait_idle() {
	if ! wait_state "$1" '^idle$' 30; then
		show_logs
		skip "slurmctld/slurmd did not bring node $1 to idle (state '$(node_state "$1")'); logs above"
	fi
}
