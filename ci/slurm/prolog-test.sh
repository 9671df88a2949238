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
slurm_start
slurm_wait_idle "$HOST"
say "cluster up: node $HOST idle, ports $PORT/$((PORT + 1)), config $SLURM_CONF"

# --- checks (pass/fail count into $passed/$failed: lib.sh) -----------------

T60=$(slurm_scale 60) # a hung srun, not a slow one

# 1. A requirement that holds here: the job runs.
echo "nic=lo" >"$REQUIRE_FILE"
rm -f "$WORK/prolog-rc" "$WORK/prolog-report.json"
if out=$(timeout "$T60" srun -N1 -t 1 true 2>&1); then
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
		echo "nic=lo" >"$REQUIRE_FILE"
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
