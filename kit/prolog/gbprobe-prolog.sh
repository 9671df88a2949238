#!/bin/bash
# Slurm Prolog for a mixed NVIDIA + AMD cluster: gbprobe --require with the
# words of the job's partition, so a node whose GPUs, driver or fabric went
# missing is drained with gbprobe's reason before a job lands on it.
#
#   slurm.conf:  Prolog=/etc/slurm/gbprobe-prolog.sh
#                PrologFlags=Alloc     # at allocation, on every node, before the first step
#   /etc/gpubridge/prolog.conf (GPUBRIDGE_PROLOG_CONF moves it): one line per
#   partition, "PARTITION WORDS" ('*' for every other partition; a partition
#   with no line and no '*' is not checked), e.g.
#       gpu-nvidia  nvidia,gpus>=8,ib
#       gpu-amd     amd,gpus>=8,roce
#
# A heterogeneous job is one job per component, each with its own partition:
# every node is checked with its component's words. The report of the last
# check is kept in $GPUBRIDGE_PROLOG_DIR/<job>.json (default /run/gpubridge).
# Exit 0 the node may run the job; 1 it may not (the node is drained with
# gbprobe's first failed requirement as the reason, and Slurm requeues or
# fails the job).
set -uo pipefail

GBPROBE=${GBPROBE:-/usr/local/bin/gbprobe}
conf=${GPUBRIDGE_PROLOG_CONF:-/etc/gpubridge/prolog.conf}
dir=${GPUBRIDGE_PROLOG_DIR:-/run/gpubridge}
part=${SLURM_JOB_PARTITION:-}
job=${SLURM_JOB_ID:-unknown}
node=${SLURMD_NODENAME:-$(hostname -s)}

drain() { # drain REASON: drain this node with REASON, refuse the job
	scontrol update nodename="$node" state=drain reason="$1"
	logger -t gbprobe-prolog "job $job partition $part: drained $node: $1" 2>/dev/null || true
	exit 1
}

# The job's environment never reaches a prolog, but slurmd's might: no
# GPUBRIDGE_* setting (a simulated vendor, a fake sysfs root, requirements)
# may change what is judged.
for v in $(compgen -e | grep '^GPUBRIDGE_' || true); do
	[ "$v" = GPUBRIDGE_PROLOG_CONF ] || [ "$v" = GPUBRIDGE_PROLOG_DIR ] || unset "$v"
done

[ -r "$conf" ] || drain "gbprobe-prolog: cannot read $conf"
words=$(awk -v p="$part" '$1 == p { print $2; found = 1; exit } $1 == "*" && !dflt { dflt = $2 } END { if (!found && dflt) print dflt }' "$conf")
[ -n "$words" ] || exit 0 # this partition is not checked
[ -x "$GBPROBE" ] || drain "gbprobe-prolog: $GBPROBE is missing"

mkdir -p "$dir"
err=$(mktemp)
"$GBPROBE" --json --require "$words" >"$dir/$job.json" 2>"$err"
rc=$?
if [ "$rc" -ne 0 ]; then
	# exit 1: a requirement failed; 2: gbprobe could not probe (a bad word).
	reason=$(grep -m1 '^gbprobe: requirement ' "$err" || grep -m1 '^gbprobe: ' "$err" || echo "gbprobe: exit $rc")
	rm -f "$err"
	drain "$reason"
fi
rm -f "$err"
exit 0
