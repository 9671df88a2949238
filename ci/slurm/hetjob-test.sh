#!/usr/bin/env bash
# The cluster kit (kit/) on a real Slurm: two node names on this host
# (gbnv0, gbamd0), each the only node of its partition (nvidia, amd), and
# the kit's gbprobe prolog with a different --require per partition. In CPU
# simulation (KIT_SIMULATE=1: every rank stands in for its component's
# vendor) it submits, through sbatch:
#
#   - the hetjob launch (srun --het-group=0,1) and its torchrun variant,
#     checking that each component's ranks got its vendor, that each vendor's
#     ranks are one contiguous block, and the discovery namespace;
#   - validation steps 1, 2, 3, 5 (PASS), 4 and 6 (NOT RUN, exit 77, with
#     their reasons), and step 1 with a --require that cannot hold (the job
#     FAILs with exit 1 and the verdict names the node and requirement);
#   - the prolog refusing a component whose partition's words do not hold;
#   - kit/summary.py over the outputs;
#
# after the kit's unit tests (kit/tests). Deadlines scale with
# GPUBRIDGE_TEST_TIMEOUT_SCALE; jobs are waited on by state, never by sleeping
# a fixed time.
#
#   ci/slurm/hetjob-test.sh BIN_DIR PYTHON     (the tools, and a python with torch and pytest)
#   KIT_TEST_PYTHONPATH=DIR: the gpubridge package the ranks import (default torchplugin/)
#
# Needs root (Slurm). Exit: 0 every check passed; 1 a check failed (FAIL
# lines say which; job outputs and daemon logs follow); 2 bad usage; 77
# Slurm cannot run here (not root, install failed, daemons did not come up).
# See ci/slurm/README.md.
set -euo pipefail

SLURM_TEST_NAME="slurm hetjob test"
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
# shellcheck source=ci/slurm/lib.sh
. "$HERE/lib.sh"

slurm_need_root "installs slurm-wlm and munge, runs slurmd"
BIN=${1:-${GPUBRIDGE_BIN_DIR:-}}
PY=${2:-${KIT_TEST_PYTHON:-}}
for t in gbprobe gbdiscover gbbridge; do
	if [ -z "$BIN" ] || [ ! -x "$BIN/$t" ]; then
		say "usage: $0 BIN_DIR PYTHON: no executable $t in '$BIN'"
		exit 2
	fi
done
if [ -z "$PY" ] || ! "$PY" -c 'import torch, pytest' 2>/dev/null; then
	say "usage: $0 BIN_DIR PYTHON: '$PY' is not a python with torch and pytest"
	exit 2
fi
BIN=$(cd "$BIN" && pwd)
# The plugin the ranks import (default: this checkout's torchplugin/).
PLUGIN=${KIT_TEST_PYTHONPATH:-$REPO/torchplugin}

T0=$SECONDS
# --- the kit's unit tests (no Slurm) -----------------------------------------
say "kit unit tests (kit/tests)"
if ! (cd "$REPO/kit" && PYTHONPATH="$PLUGIN" GPUBRIDGE_BIN_DIR="$BIN" timeout "$(slurm_scale 300)" "$PY" -m pytest -q -p no:cacheprovider tests >&2); then
	echo "slurm hetjob test: kit unit tests failed"
	exit 1
fi

slurm_install

# --- the cluster ------------------------------------------------------------
SLURM_TEST_SCHEDULER=sched/backfill # the only scheduler that starts heterogeneous jobs
SLURM_TEST_PORTS=4                  # slurmctld, and a slurmd per node name
# A requeued job waits the credentials' lifetime + 1 s before it runs again
# (its earlier credential is revoked until then): 30 s instead of 120 keeps
# the requeue check short and is still ample for a step to launch.
SLURM_TEST_CRED_EXPIRE=30
slurm_init gbkit-slurm
MEM=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.3)}' /proc/meminfo)
mkdir -p "$WORK/prolog"
# A heterogeneous job's components never share a node in the backfill
# planner of this Slurm (22.05 reserves whole nodes), so each partition has
# a node of its own: two node names on this host, each with its own
# NodeHostname (this slurmd is not built for multiple slurmds and refuses one
# twice) and port. CPUs are declared (config_overrides) so that the 2-core
# CI machine runs 2 + 1 tasks per job.
slurm_write_conf \
	"SchedulerParameters=bf_interval=1" \
	"SlurmdParameters=config_overrides" \
	"Prolog=$WORK/prolog.sh" \
	"PrologFlags=Alloc" \
	"NodeName=gbnv0 NodeHostname=gbnv0 NodeAddr=127.0.0.1 Port=$((PORT + 2)) CPUs=4 RealMemory=$MEM State=UNKNOWN" \
	"NodeName=gbamd0 NodeHostname=gbamd0 NodeAddr=127.0.0.1 Port=$((PORT + 3)) CPUs=4 RealMemory=$MEM State=UNKNOWN" \
	"PartitionName=nvidia Nodes=gbnv0 Default=YES MaxTime=15 State=UP" \
	"PartitionName=amd Nodes=gbamd0 MaxTime=15 State=UP"

# The kit's prolog, as a site installs it, with this cluster's paths.
PROLOG_CONF=$WORK/prolog.conf
printf 'nvidia nic=lo\namd no-problems\n' >"$PROLOG_CONF"
cat >"$WORK/prolog.sh" <<EOF
#!/bin/bash
export SLURM_CONF=$SLURM_CONF GBPROBE=$BIN/gbprobe GPUBRIDGE_PROLOG_CONF=$PROLOG_CONF GPUBRIDGE_PROLOG_DIR=$WORK/prolog
exec "$REPO/kit/prolog/gbprobe-prolog.sh"
EOF
chmod 755 "$WORK/prolog.sh"

slurm_start gbnv0 gbamd0
slurm_wait_idle gbnv0
slurm_wait_idle gbamd0
say "cluster up: nodes gbnv0 (partition nvidia), gbamd0 (partition amd) idle, ports $PORT-$((PORT + 3)), config $SLURM_CONF"

# --- the kit, configured for this cluster -----------------------------------
KIT=$WORK/kit
cp -r "$REPO/kit" "$KIT"
rm -rf "$KIT/out" "$KIT/tests"
cat >"$KIT/site.env" <<EOF
KIT_PARTITIONS=(nvidia amd)
KIT_VENDORS=(nvidia amd)
KIT_NODES=(1 1)
KIT_GPUS_PER_NODE=(2 1)
KIT_REQUIRE=("nvidia,nic=lo" "amd,no-problems")
KIT_PYTHON=("$PY" "$PY")
KIT_SBATCH_EXTRA=("" "")
KIT_TIME=00:10:00
KIT_SIMULATE=1
export GPUBRIDGE_BIN_DIR=$BIN GPUBRIDGE_BIN_STRICT=1 GPUBRIDGE_NO_BUILD=1 PYTHONPATH=$PLUGIN OMP_NUM_THREADS=1
EOF
sed 's/^KIT_REQUIRE=.*/KIT_REQUIRE=("nvidia,nic=lo" "nvidia")/' "$KIT/site.env" >"$KIT/site-fail.env"
"$KIT/configure" >&2
OUT=$KIT/out

# --- checks (pass/fail count into $passed/$failed: lib.sh) -----------------

FINAL='^(COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE|PREEMPTED)$'
JOB_STATE=""
JOB_EXIT=""
# submit NAME [ENV=VAL...] -- SCRIPT [ARGS...]: sbatch SCRIPT, wait until
# every component of the job has ended (by state; the deadline is for a
# hang), and set JOB, JOB_IDS (every component's job id), JOB_STATE (the
# batch component's) and JOB_EXIT (the batch script's exit status).
submit() {
	local name=$1 envs=()
	shift
	while [ "$1" != -- ]; do
		envs+=("$1")
		shift
	done
	shift
	JOB=$(cd "$KIT" && env "${envs[@]}" sbatch --parsable "$@" | cut -d';' -f1) || {
		JOB=""
		JOB_STATE=unsubmitted
		JOB_EXIT=""
		return
	}
	wait_job "$name" "$JOB"
}

# wait_job NAME JOB: wait until every component of JOB has ended; set
# JOB_IDS, JOB_STATE, JOB_EXIT.
wait_job() {
	local name=$1 JOB=$2 t0=$SECONDS
	local deadline=$((SECONDS + $(slurm_scale 300))) lines states
	while :; do
		lines=$(timeout 10 scontrol show job -o "$JOB" 2>/dev/null || true)
		states=$(grep -o 'JobState=[A-Z_]*' <<<"$lines" | cut -d= -f2 || true)
		if [ -n "$states" ] && ! grep -Evq "$FINAL" <<<"$states"; then
			break
		fi
		if [ "$SECONDS" -ge "$deadline" ]; then
			say "$name: job $JOB still not done after $(slurm_scale 300)s: $(tr '\n' ' ' <<<"$states")"
			timeout 10 scancel "$JOB" 2>/dev/null || true
			break
		fi
		sleep 0.3
	done
	JOB_IDS=$(grep -o '^JobId=[0-9]*' <<<"$lines" | cut -d= -f2 | tr '\n' ' ' || true)
	JOB_STATE=$(head -n 1 <<<"$lines" | grep -o 'JobState=[A-Z_]*' | cut -d= -f2 || true)
	JOB_EXIT=$(head -n 1 <<<"$lines" | grep -o ' ExitCode=[0-9]*' | cut -d= -f2 || true)
	say "$name: job $JOB $JOB_STATE, exit ${JOB_EXIT:-?} ($(tr '\n' ' ' <<<"$states")), $((SECONDS - t0)) s"
}

# job_output JOB: the job's output file (the scripts' --output).
job_output() { ls "$OUT"/*-"$1".out 2>/dev/null | head -n 1; }
# verdict_line JOB STEP: the step's one-line verdict in the job's output.
verdict_line() { grep -E "^kit step $2 [a-z]+: (PASS|FAIL|ERROR|NOT RUN): " "$(job_output "$1")" 2>/dev/null | tail -n 1 || true; }
show_job() { # the job's output, on a failed check
	local f
	f=$(job_output "$1")
	[ -n "$f" ] && {
		echo "----- $f (last 40 lines)" >&2
		tail -n 40 "$f" >&2
	}
}
rows_of() { ls -d "$OUT"/*-"$1"/rows.jsonl 2>/dev/null | head -n 1; }

# check_ranks JOB LAUNCHER NAMESPACE_PREFIX: every rank row of the job says
# that each component got its vendor, each vendor's ranks are contiguous
# (nvidia 0-1, amd 2), and the namespace is the job's. Prints the problem.
check_ranks() {
	"$PY" - "$(rows_of "$1")" "$2" "$3" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
ranks = {r["rank"]: r for r in rows if r.get("schema") == "gpubridge.kit-rank/v1"}
want = {0: (0, "nvidia"), 1: (0, "nvidia"), 2: (1, "amd")}
problems = []
if sorted(ranks) != sorted(want):
    problems.append(f"rank rows for {sorted(ranks)}, want {sorted(want)}")
for rank, (comp, vendor) in want.items():
    r = ranks.get(rank)
    if r is None:
        continue
    if (r["component"], r["vendor_expected"], r["island_vendor"], r["partition"]) != (comp, vendor, vendor, vendor):
        problems.append(f"rank {rank}: component {r['component']} partition {r['partition']} expected {r['vendor_expected']} island {r['island_vendor']}, want component {comp} {vendor}")
    if not r["namespace"].startswith(sys.argv[3]):
        problems.append(f"rank {rank}: namespace {r['namespace']!r}, want it to start {sys.argv[3]!r}")
    if r["launcher"] != sys.argv[2]:
        problems.append(f"rank {rank}: launcher {r['launcher']}, want {sys.argv[2]}")
for vendor in ("nvidia", "amd"):
    got = sorted(k for k, r in ranks.items() if r["island_vendor"] == vendor)
    if got and got != list(range(got[0], got[-1] + 1)):
        problems.append(f"{vendor} ranks {got} are not contiguous")
checks = [r for r in rows if r.get("schema") == "gpubridge.kit-layout-check/v1"]
if not checks or not checks[0]["ok"] or not checks[0]["checked"]:
    problems.append(f"layout check: {checks}")
train = [r for r in rows if r.get("schema") == "gpubridge.kit-train/v1"]
if not train or not train[0]["params_in_sync"] or train[0]["tokens_per_s"] <= 0:
    problems.append(f"training row: {train}")
print("; ".join(problems))
PY
}

# 1. The hetjob launch, srun --het-group=0,1: one task per rank.
submit "launch (srun)" -- launch/hetjob.sbatch
if [ "$JOB_STATE" != COMPLETED ] || [ "$JOB_EXIT" != 0 ]; then
	fail "launch/hetjob.sbatch: job $JOB $JOB_STATE exit $JOB_EXIT"
	show_job "$JOB"
elif p=$(check_ranks "$JOB" srun "job-$JOB/attempt-0/") && [ -z "$p" ]; then
	pass "launch/hetjob.sbatch: nvidia ranks 0-1 on gbnv0, amd rank 2 on gbamd0, namespace job-$JOB/attempt-0, DDP trained, parameters identical"
else
	fail "launch/hetjob.sbatch: ${p:-the rank check did not run}"
	show_job "$JOB"
fi
LAUNCH_IDS=$JOB_IDS
LAUNCH_JOB=$JOB

# 1b. The same job requeued (same job id, SLURM_RESTART_COUNT=1) discovers
# in a fresh namespace. It may start again once its earlier credential has
# expired (EligibleTime: SLURM_TEST_CRED_EXPIRE above); this Slurm then
# leaves it pending for a minute or two more (Reason=BeginTime), so once it
# is eligible the test asks for it to start now.
requeue_now() { # requeue_now JOB
	timeout 10 scontrol requeue "$1" || return 1
	local el e deadline=$((SECONDS + $(slurm_scale 120)))
	el=$(timeout 10 scontrol show job -o "$1" | head -n 1 | grep -o 'EligibleTime=[^ ]*' | cut -d= -f2)
	e=$(date -d "$el" +%s) || return 1
	while [ "$(date +%s)" -le "$e" ] && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.5; done
	timeout 10 scontrol update jobid="$1" StartTime=now
}
if [ "$JOB_STATE" = COMPLETED ] && requeue_now "$LAUNCH_JOB"; then
	wait_job "launch (srun), requeued" "$LAUNCH_JOB"
	restarts=$(timeout 10 scontrol show job -o "$LAUNCH_JOB" | grep -o -m1 'Restarts=[0-9]*' | head -n 1 | cut -d= -f2)
	if [ "$JOB_STATE" != COMPLETED ] || [ "$JOB_EXIT" != 0 ] || [ "$restarts" != 1 ]; then
		fail "requeued launch: job $LAUNCH_JOB $JOB_STATE exit $JOB_EXIT restarts $restarts"
		show_job "$LAUNCH_JOB"
	elif p=$(check_ranks "$LAUNCH_JOB" srun "job-$LAUNCH_JOB/attempt-1/") && [ -z "$p" ] &&
		[ -s "$OUT/launch-srun-$LAUNCH_JOB/rows.before-restart-1.jsonl" ]; then
		pass "requeued launch (restart 1): namespace job-$LAUNCH_JOB/attempt-1, the first attempt's rows kept aside"
	else
		fail "requeued launch: ${p:-no rows.before-restart-1.jsonl with the first attempt}"
		show_job "$LAUNCH_JOB"
	fi
else
	fail "could not requeue job $LAUNCH_JOB ($JOB_STATE)"
fi

# 2. The same through one torchrun per node.
submit "launch (torchrun)" -- launch/hetjob-torchrun.sbatch
if [ "$JOB_STATE" != COMPLETED ] || [ "$JOB_EXIT" != 0 ]; then
	fail "launch/hetjob-torchrun.sbatch: job $JOB $JOB_STATE exit $JOB_EXIT"
	show_job "$JOB"
elif p=$(check_ranks "$JOB" torchrun "job-slurm-$JOB-0/") && [ -z "$p" ]; then
	pass "launch/hetjob-torchrun.sbatch: torchrun per node, nvidia ranks 0-1, amd rank 2, run id slurm-$JOB-0"
else
	fail "launch/hetjob-torchrun.sbatch: ${p:-the rank check did not run}"
	show_job "$JOB"
fi

# step_check STEP NAME SCRIPT WANT_RESULT WANT_EXIT [ENV=VAL...]: submit the
# step and check its job state, exit status and one-line verdict; sets V.
step_check() {
	local step=$1 name=$2 script=$3 result=$4 code=$5
	shift 5
	submit "step $step" "$@" -- "$script"
	V=$(verdict_line "$JOB" "$step")
	local state=COMPLETED
	[ "$code" -ne 0 ] && state=FAILED
	if [ "$JOB_STATE" != "$state" ] || [ "$JOB_EXIT" != "$code" ] || [[ $V != "kit step $step $name: $result: "* ]]; then
		fail "$script: job $JOB $JOB_STATE exit $JOB_EXIT, verdict '$V'; want $state, exit $code, $result"
		show_job "$JOB"
		return 1
	fi
}

# 3. Validation steps.
if step_check 1 probe steps/1-probe.sbatch PASS 0; then
	p=$("$PY" - "$(rows_of "$JOB")" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"gpubridge.kit-probe/v1"' in l]
got = sorted((r["node"], r["partition"], r["require"], r["vendor_found"], r["ok"]) for r in rows)
want = [("gbamd0", "amd", "amd,no-problems", "amd", True), ("gbnv0", "nvidia", "nvidia,nic=lo", "nvidia", True)]
print("" if got == want else f"probe rows {got}, want {want}")
PY
	)
	[ -z "$p" ] && pass "step 1: gbprobe on gbnv0 (--require nvidia,nic=lo) and gbamd0 (--require amd,no-problems): $V" || fail "step 1: $p"
fi
if step_check 2 bridge steps/2-bridge.sbatch PASS 0; then
	[[ $V == *"selftest over tcp between 2 leaders"* ]] && pass "step 2: $V" || fail "step 2: verdict '$V' does not say tcp between 2 leaders"
fi
if step_check 3 collectives steps/3-collectives.sbatch PASS 0; then
	n=$(grep -c '"schema":"gpubridge.kit-collectives/v1".*"ok":true' "$(rows_of "$JOB")" || true)
	[ "$n" -ge 150 ] && pass "step 3: $n checks exact: $V" || fail "step 3: only $n exact check rows"
fi
step_check 4 sweep steps/4-sweep.sbatch "NOT RUN" 77 && pass "step 4: exit 77: $V"
if step_check 5 train steps/5-train.sbatch PASS 0; then
	modes=$(grep -o '"schema":"gpubridge.kit-train/v1","parallel":"[a-z]*"' "$(rows_of "$JOB")" | cut -d'"' -f8 | tr '\n' ' ')
	[ "$modes" = "ddp fsdp " ] && pass "step 5: $V" || fail "step 5: training rows for '$modes', want ddp and fsdp"
fi
if step_check 6 trace steps/6-trace.sbatch PASS 0; then
	[[ $V == *"collectives of "*", all complete; all_reduce <= "* ]] && pass "step 6: gbtrace on step 5's trace: $V" || fail "step 6: verdict '$V'"
fi

# 4. A step that fails fails its job, with its verdict: the amd component
# asked to hold an NVIDIA GPU.
if step_check 1 probe steps/1-probe.sbatch FAIL 1 KIT_CONFIG="$KIT/site-fail.env"; then
	want="kit step 1 probe: FAIL: component 1 (partition amd) node gbamd0, --require 'nvidia': gbprobe: requirement nvidia failed"
	[[ $V == "$want"* ]] && pass "step 1 with a --require that cannot hold: job FAILED, exit 1: $V" || fail "step 1 failing: verdict '$V', want it to start '$want'"
fi

# 5. The prolog ran on both components of the launch job with its
# partition's words, and refuses a component whose words do not hold.
p=$("$PY" - "$WORK/prolog" $LAUNCH_IDS <<'PY'
import json, sys
d, ids = sys.argv[1], sys.argv[2:]  # the components' job ids, in component order
got = []
for j in ids:
    try:
        rep = json.load(open(f"{d}/{j}.json"))
    except OSError as e:
        print(f"no prolog report for job {j}: {e}")
        sys.exit()
    got.append([(r["require"], r["ok"]) for r in rep["requirements"]])
want = [[("nic=lo", True)], [("no-problems", True)]]
print("" if got == want else f"prolog requirements {got} for jobs {ids}, want {want}")
PY
)
[ -z "$p" ] && pass "prolog: component 0 (nvidia) checked nic=lo, component 1 (amd) no-problems" || fail "prolog: $p"
bad=nvidia
"$BIN/gbprobe" --require nvidia >/dev/null 2>&1 && bad=nic=gbprobe-absent0 # this host has an NVIDIA GPU
printf 'nvidia nic=lo\namd %s\n' "$bad" >"$PROLOG_CONF"
if out=$(timeout "$(slurm_scale 120)" srun -p nvidia -n1 true : -p amd -n1 true 2>&1); then
	fail "prolog: a hetjob whose amd component requires $bad ran"
else
	reason=$(node_reason gbamd0)
	if [[ $(node_state gbamd0) =~ drain ]] && [[ $reason == "gbprobe: requirement $bad failed"* ]]; then
		pass "prolog: --require $bad on partition amd refused the hetjob, drained gbamd0: $reason"
	else
		fail "prolog: srun failed ($(tr '\n' ' ' <<<"$out")) but gbamd0 is '$(node_state gbamd0)', reason '$reason'"
	fi
fi
printf 'nvidia nic=lo\namd no-problems\n' >"$PROLOG_CONF"
timeout 10 scontrol update nodename=gbamd0 state=resume || true
wait_state gbamd0 '^idle$' 30 || fail "gbamd0 did not resume"

# 6. The report.
rc=0
"$PY" "$KIT/summary.py" "$OUT" -o "$WORK/report.md" 2>/dev/null || rc=$?
if [ "$rc" = 1 ] && grep -q '^| 1 | probe | .* | \*\*FAIL\*\* |' "$WORK/report.md" &&
	grep -q '^| 3 | collectives | .* | PASS |' "$WORK/report.md" && grep -q '^| 4 | sweep | .* | NOT RUN |' "$WORK/report.md"; then
	pass "kit/summary.py: one Markdown report, exit 1 (the failing step 1 is the newest), steps 3 PASS and 4 NOT RUN"
else
	fail "kit/summary.py: exit $rc; report: $(head -c 2000 "$WORK/report.md" 2>/dev/null)"
fi

# 7. Nothing left behind by the jobs.
left=$(pgrep -f "$KIT/" || true)
[ -z "$left" ] && pass "no process of the kit's jobs left" || fail "processes left: $(ps -o pid,args -p "$(tr '\n' ',' <<<"$left" | sed 's/,$//')" 2>/dev/null)"

say "took $((SECONDS - T0)) s"
echo "slurm hetjob test: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
