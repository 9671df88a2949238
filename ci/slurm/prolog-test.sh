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

SLURM_TEST_NAME="slurm prolog test"
# shellcheck source=ci/slurm/lib.sh
. "$(dirname "$0")/lib.sh"

GBPROBE=${1:-${GBPROBE:-}}
if [ -z "$GBPROBE" ] || [ ! -x "$GBPROBE" ]; then
	say "usage: $0 PATH/TO/gbprobe (or GBPROBE=...): got '${GBPROBE}', not an executable"
	exit 2
fi
GBPROBE=$(readlink -f "$GBPROBE")
slurm_need_root "installs slurm-wlm and munge, runs slurmd"
slurm_install

# --- the cluster's files ----------------------------------------------------
slurm_init gbprobe-slurm
MEM=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)
slurm_write_conf \
	"Prolog=$WORK/prolog.sh" \
	"PrologFlags=Alloc" \
	"NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=$MEM State=UNKNOWN" \
	"PartitionName=gbprobe Nodes=$HOST Default=YES MaxTime=10 State=UP"

# The prolog is the kit's (kit/prolog/gbprobe-prolog.sh): gbprobe decides;
# on failure it drains the node with gbprobe's first failed requirement as
# the reason, then refuses the job. Here it runs with this test's gbprobe,
# the words of $PROLOG_CONF for every partition, and its reports in
# $REPORTS; the wrapper records its exit status for the checks.
KIT_PROLOG=$(readlink -f "$(dirname "$0")/../../kit/prolog/gbprobe-prolog.sh")
PROLOG_CONF=$WORK/prolog.conf
REPORTS=$WORK/prolog
require() { echo "* $1" >"$PROLOG_CONF"; }
report() { ls -t "$REPORTS"/*.json 2>/dev/null | head -n 1; }
cat >"$WORK/prolog.sh" <<EOF
#!/bin/bash
# Slurm Prolog (as root, on the node, before the job).
export SLURM_CONF=$SLURM_CONF GBPROBE=$GBPROBE GPUBRIDGE_PROLOG_CONF=$PROLOG_CONF GPUBRIDGE_PROLOG_DIR=$REPORTS
"$KIT_PROLOG"
rc=\$?
echo "\$rc" >"$WORK/prolog-rc"
exit \$rc
EOF
chmod 755 "$WORK/prolog.sh"

# --- start the daemons ------------------------------------------------------
slurm_start
slurm_wait_idle "$HOST"
say "cluster up: node $HOST idle, ports $PORT/$((PORT + 1)), config $SLURM_CONF"

# --- checks (pass/fail count into $passed/$failed: lib.sh) -----------------

T60=$(slurm_scale 60) # a hung srun, not a slow one

# 1. A requirement that holds here: the job runs.
require nic=lo
rm -rf "$WORK/prolog-rc" "$REPORTS"
if out=$(timeout "$T60" srun -N1 -t 1 true 2>&1); then
	if [ "$(cat "$WORK/prolog-rc" 2>/dev/null)" = 0 ] && grep -q '"schema": "gpubridge.probe/v1"' "$(report)"; then
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
require "$fail_req"
rm -f "$WORK/prolog-rc"
want_reason=$("$GBPROBE" --require "$fail_req" 2>&1 >/dev/null | grep -m1 '^gbprobe: requirement ' || true)
if out=$(timeout "$T60" srun -N1 -t 1 true 2>&1); then
	fail "--require $fail_req: srun -N1 true succeeded, want it refused"
else
	rc=$?
	state=$(node_state "$HOST")
	reason=$(node_reason "$HOST")
	if [ "$rc" -eq 124 ]; then
		fail "--require $fail_req: srun hung (timeout ${T60}s)"
	elif [ "$(cat "$WORK/prolog-rc" 2>/dev/null)" != 1 ]; then
		fail "--require $fail_req: srun failed (exit $rc) but not through gbprobe (prolog-rc '$(cat "$WORK/prolog-rc" 2>/dev/null)'): $out"
	elif [[ ! $state =~ drain ]]; then
		fail "--require $fail_req: node state '$state', want drained"
	elif [ -z "$want_reason" ] || [[ $reason != *"$want_reason"* ]]; then
		fail "--require $fail_req: node Reason '$reason', want it to contain '$want_reason'"
	else
		say "srun (exit $rc): $(echo "$out" | tr '\n' ' ')"
		say "node $HOST: State=$state Reason=$reason"
		timeout "$(slurm_scale 10)" scontrol update nodename="$HOST" state=resume
		require nic=lo
		if ! wait_state "$HOST" '^idle$' 15; then
			fail "--require $fail_req: refused and drained, but the node did not resume"
		elif ! timeout "$T60" srun -N1 -t 1 true >/dev/null 2>&1; then
			fail "--require $fail_req: refused and drained, resumed, but the next job failed"
		else
			pass "--require $fail_req fails: job refused (srun exit $rc), node drained with gbprobe's reason, resumed and ran the next job"
		fi
	fi
fi

echo "slurm prolog test: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
