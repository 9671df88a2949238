#!/usr/bin/env bash
# The test suite under load: runs `make test` N times in a row (default 3)
# while two CPU hogs (busy loops, one per core of the CI machine's kind) run
# beside it, and stops at the first failure, saying which run failed.
#
#   ci/loaded-test.sh [N]
#
# The hogs are started here and always killed, by PID, when the script ends
# (success, failure or interrupt). Each run's output goes to the console and
# to out/loaded-test/run-K.log. Deadlines in the tests are for hangs; if a
# loaded machine needs more, GPUBRIDGE_TEST_TIMEOUT_SCALE (passed through)
# stretches them all, but the suite is meant to pass without it.
# Exit: 0 all N runs passed; 1 a run failed; 2 bad usage.
set -euo pipefail
cd "$(dirname "$0")/.."

n=${1:-3}
if ! [[ $n =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: ci/loaded-test.sh [N]   (N runs of make test under load, default 3)" >&2
  exit 2
fi
logs=out/loaded-test
mkdir -p "$logs"

hogs=()
stop_hogs() {
  local p
  for p in "${hogs[@]}"; do
    kill "$p" 2>/dev/null || true
  done
  for p in "${hogs[@]}"; do
    wait "$p" 2>/dev/null || true
  done
  hogs=()
}
trap stop_hogs EXIT
trap 'exit 130' INT TERM

for _ in 1 2; do
  ( while :; do :; done ) &
  hogs+=($!)
done
echo "loaded-test: 2 CPU hogs running (pids ${hogs[*]}) on $(nproc) CPUs; ${GPUBRIDGE_TEST_TIMEOUT_SCALE:+GPUBRIDGE_TEST_TIMEOUT_SCALE=$GPUBRIDGE_TEST_TIMEOUT_SCALE; }$n runs of make test" >&2

for k in $(seq 1 "$n"); do
  echo "loaded-test: run $k of $n" >&2
  start=$(date +%s)
  if ! make test 2>&1 | tee "$logs/run-$k.log"; then
    echo "loaded-test: run $k of $n FAILED after $(( $(date +%s) - start ))s under load; its output: $logs/run-$k.log" >&2
    exit 1
  fi
  echo "loaded-test: run $k of $n passed in $(( $(date +%s) - start ))s" >&2
done
echo "loaded-test: all $n runs of make test passed under load" >&2
