#!/usr/bin/env bash
# A real one-node Slurm cluster whose Prolog runs gbprobe --require, checked
# end to end: a requirement that holds lets a job run; one that fails refuses
# the job and drains the node with gbprobe's reason; resume brings it back.
#
#   ci/slurm/prolog-test.sh [GBPROBE]     (or GBPROBE=path/to/gbprobe)
#
# Needs root. Installs Debian's slurm-wlm and munge when missing. Everything
# else lives in a temporary directory: its own munged (own key and socket),
# its own slurm.conf/cgroup.conf (SLURM_CONF), spool and state, and ports
# 16817/16818 (SLURM_TEST_PORT moves them). /etc/slurm and /etc/munge are not
# touched. The daemons it starts are stopped, by PID, whatever happens.
#
# Exit: 0 all checks passed; 1 a check failed; 2 bad usage (no gbprobe);
# 77 Slurm cannot run here (not root, install failed, daemons did not come
# up) - the reason is printed. See ci/slurm/README.md.
set -euo pipefail

SKIP=77
say() { printf 'slurm prolog test: %s\n' "$*" >&2; }
skip() {
	say "SKIPPED (exit $SKIP): $*"
	exit $SKIP
}

GBPROBE=${1:-${GBPROBE:-}}
if [ -z "$GBPROBE" ] || [ ! -x "$GBPROBE" ]; then
	say "usage: $0 PATH/TO/gbprobe (or GBPROBE=...): got '${GBPROBE}', not an executable"
	exit 2
fi
GBPROBE=$(readlink -f "$GBPROBE")
[ "$(id -u)" -eq 0 ] || skip "needs root (installs slurm-wlm and munge, runs slurmd)"

# --- install ----------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
	say "installing slurm-wlm and munge (apt-get)"
	export DEBIAN_FRONTEND=noninteractive
	if ! apt-get -y -q install slurm-wlm munge >/tmp/gbprobe-slurm-apt.log 2>&1; then
		apt-get -q update >>/tmp/gbprobe-slurm-apt.log 2>&1 || true
		apt-get -y -q install slurm-wlm munge >>/tmp/gbprobe-slurm-apt.log 2>&1 ||
			skip "apt-get install slurm-wlm munge failed; see /tmp/gbprobe-slurm-apt.log: $(tail -n 3 /tmp/gbprobe-slurm-apt.log | tr '\n' ' ')"
	fi
fi
for c in slurmctld slurmd munged munge srun scontrol sinfo timeout; do
	command -v $c >/dev/null || skip "$c not found after installing slurm-wlm and munge"
done

# --- the cluster's files ----------------------------------------------------
WORK=$(mktemp -d /tmp/gbprobe-slurm.XXXXXX)
chmod 755 "$WORK"
mkdir -p "$WORK/etc" "$WORK/munge-key" "$WORK/munge" "$WORK/state" "$WORK/spool" "$WORK/log"
chmod 700 "$WORK/munge-key"
chmod 755 "$WORK/munge"
export SLURM_CONF=$WORK/etc/slurm.conf
HOST=$(hostname -s)
PIDS=()

show_logs() {
	for f in "$WORK"/log/*; do
		[ -s "$f" ] || continue
		echo "----- $f (last 25 lines)" >&2
		tail -n 25 "$f" >&2
	done
}

cleanup() {
	local rc=$?
	local i
	# Stop in reverse start order: slurmd, slurmctld, munged.
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
	if [ "$rc" -ne 0 ] && [ "$rc" -ne "$SKIP" ]; then
		show_logs
	fi
	if [ -n "${KEEP_SLURM_TEST:-}" ]; then
		say "kept $WORK"
	else
		rm -rf "$WORK"
	fi
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
PORT=${SLURM_TEST_PORT:-16817}
for _ in $(seq 20); do
	if port_free "$PORT" && port_free $((PORT + 1)); then break; fi
	PORT=$((PORT + 2))
done
port_free "$PORT" && port_free $((PORT + 1)) || skip "no free port pair near ${SLURM_TEST_PORT:-16817}"

dd if=/dev/urandom of="$WORK/munge-key/munge.key" bs=1024 count=1 status=none
chmod 400 "$WORK/munge-key/munge.key"

MEM=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)
cat >"$SLURM_CONF" <<EOF
ClusterName=gbprobetest
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
AuthType=auth/munge
AuthInfo=socket=$WORK/munge/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.pid
SlurmctldLogFile=$WORK/log/slurmctld.log
SlurmdLogFile=$WORK/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
Prolog=$WORK/prolog.sh
PrologFlags=Alloc
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=$MEM State=UNKNOWN
PartitionName=gbprobe Nodes=$HOST Default=YES MaxTime=10 State=UP
EOF
# CgroupPlugin=disabled makes this slurmd refuse to start; cgroup/v1 works
# (ProctrackType and TaskPlugin above do not use it).
echo "CgroupPlugin=cgroup/v1" >"$WORK/etc/cgroup.conf"

# The prolog: gbprobe decides; on failure it drains the node with gbprobe's
# first failed requirement as the reason, then refuses the job.
REQUIRE_FILE=$WORK/require
cat >"$WORK/prolog.sh" <<EOF
#!/bin/bash
# Slurm Prolog (as root, on the node, before the job). Requirements come
# from $REQUIRE_FILE.
set -uo pipefail
export SLURM_CONF=$SLURM_CONF
require=\$(cat "$REQUIRE_FILE")
"$GBPROBE" --json --require "\$require" >"$WORK/prolog-report.json" 2>"$WORK/prolog-stderr"
rc=\$?
echo "\$rc" >"$WORK/prolog-rc"
[ "\$rc" -eq 0 ] && exit 0
reason=\$(grep -m1 '^gbprobe: requirement ' "$WORK/prolog-stderr" || grep -m1 '^gbprobe: ' "$WORK/prolog-stderr" || echo "gbprobe: exit \$rc")
scontrol update nodename="\$SLURMD_NODENAME" state=drain reason="\$reason"
exit 1
EOF
chmod 755 "$WORK/prolog.sh"

# --- start the daemons ------------------------------------------------------
munged -F --force --key-file="$WORK/munge-key/munge.key" --socket="$WORK/munge/munge.socket" \
	--pid-file="$WORK/munge/munged.pid" --log-file="$WORK/log/munged.log" \
	--seed-file="$WORK/munge/munged.seed" >"$WORK/log/munged.out" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do
	[ -S "$WORK/munge/munge.socket" ] && break
	sleep 0.1
done
munge -s gbprobe -S "$WORK/munge/munge.socket" | unmunge -S "$WORK/munge/munge.socket" >/dev/null 2>&1 ||
	skip "munged did not come up: $(tail -n 3 "$WORK/log/munged.out" "$WORK/log/munged.log" 2>/dev/null | tr '\n' ' ')"

slurmctld -D -i >"$WORK/log/slurmctld.out" 2>&1 &
PIDS+=($!)
slurmd -D -N "$HOST" >"$WORK/log/slurmd.out" 2>&1 &
PIDS+=($!)

node_state() { timeout 10 sinfo -h -n "$HOST" -o %T 2>/dev/null | head -n 1 || true; }
node_reason() { timeout 10 scontrol show node "$HOST" 2>/dev/null | sed -n 's/^ *Reason=//p' || true; }
wait_state() { # wait_state REGEX SECONDS
	local s
	for _ in $(seq $(($2 * 5))); do
		s=$(node_state)
		[[ $s =~ $1 ]] && return 0
		sleep 0.2
	done
	say "node $HOST state is '$s', want /$1/"
	return 1
}
if ! wait_state '^idle$' 30; then
	show_logs
	skip "slurmctld/slurmd did not bring node $HOST to idle (state '$(node_state)'); logs above"
fi
say "cluster up: node $HOST idle, ports $PORT/$((PORT + 1)), config $SLURM_CONF"

# --- checks -----------------------------------------------------------------
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

# 1. A requirement that holds here: the job runs.
echo "nic=lo" >"$REQUIRE_FILE"
rm -f "$WORK/prolog-rc" "$WORK/prolog-report.json"
if out=$(timeout 60 srun -N1 -t 1 true 2>&1); then
	if [ "$(cat "$WORK/prolog-rc" 2>/dev/null)" = 0 ] && grep -q '"schema": "gpubridge.probe/v1"' "$WORK/prolog-report.json"; then
		pass "--require nic=lo holds: srun -N1 true ran, after the prolog's gbprobe exited 0"
	else
		fail "srun ran but the prolog's gbprobe did not (prolog-rc '$(cat "$WORK/prolog-rc" 2>/dev/null)')"
	fi
else
	fail "--require nic=lo: srun -N1 true failed: $out"
fi

# 2. A requirement that fails here: the job is refused, the node drained
# with gbprobe's reason; resume brings it back.
fail_req=nvidia
if "$GBPROBE" --require "$fail_req" >/dev/null 2>&1; then
	fail_req=nic=gbprobe-absent0 # this node has an NVIDIA GPU
fi
echo "$fail_req" >"$REQUIRE_FILE"
rm -f "$WORK/prolog-rc"
want_reason=$("$GBPROBE" --require "$fail_req" 2>&1 >/dev/null | grep -m1 '^gbprobe: requirement ' || true)
if out=$(timeout 60 srun -N1 -t 1 true 2>&1); then
	fail "--require $fail_req: srun -N1 true succeeded, want it refused"
else
	rc=$?
	state=$(node_state)
	reason=$(node_reason)
	if [ "$rc" -eq 124 ]; then
		fail "--require $fail_req: srun hung (timeout 60s)"
	elif [ "$(cat "$WORK/prolog-rc" 2>/dev/null)" != 1 ]; then
		fail "--require $fail_req: srun failed (exit $rc) but not through gbprobe (prolog-rc '$(cat "$WORK/prolog-rc" 2>/dev/null)'): $out"
	elif [[ ! $state =~ drain ]]; then
		fail "--require $fail_req: node state '$state', want drained"
	elif [ -z "$want_reason" ] || [[ $reason != *"$want_reason"* ]]; then
		fail "--require $fail_req: node Reason '$reason', want it to contain '$want_reason'"
	else
		say "srun (exit $rc): $(echo "$out" | tr '\n' ' ')"
		say "node $HOST: State=$state Reason=$reason"
		timeout 10 scontrol update nodename="$HOST" state=resume
		echo "nic=lo" >"$REQUIRE_FILE"
		if ! wait_state '^idle$' 15; then
			fail "--require $fail_req: refused and drained, but the node did not resume"
		elif ! timeout 60 srun -N1 -t 1 true >/dev/null 2>&1; then
			fail "--require $fail_req: refused and drained, resumed, but the next job failed"
		else
			pass "--require $fail_req fails: job refused (srun exit $rc), node drained with gbprobe's reason, resumed and ran the next job"
		fi
	fi
fi

echo "slurm prolog test: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
