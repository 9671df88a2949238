#!/usr/bin/env bash
# ci/torch-suite.sh VERSION [JUNIT_XML]: the plugin's test suite
# (torchplugin/tests) on torch VERSION, in .venv-torch-VERSION (made by
# ci/torch-venv.sh), against the tools in bin/ (make build); JUNIT_XML gets
# pytest's JUnit report. Says how long it took. The fault tests run one
# victim per fault and workload here (not the victim_matrix cases: which
# rank died is gpubridge's logic, run in full on the project's torch), which
# keeps a loaded make test about 11 minutes shorter.
set -euo pipefail
cd "$(dirname "$0")/.."
v=${1:-}
junit=()
if [ -n "${2:-}" ]; then
  junit=(--junitxml "$(realpath -m "$2")")
fi
ci/torch-venv.sh "$v"
for t in gbprobe gbdiscover gbbridge; do
  [ -x "bin/$t" ] || { echo "torch-suite: bin/$t is missing: run make build" >&2; exit 2; }
done
bin=$PWD/bin
start=$SECONDS
echo "torch-suite: the plugin's tests on torch $v" >&2
(cd torchplugin && GPUBRIDGE_BIN="$bin" "../.venv-torch-$v/bin/python" -m pytest -q -m "not victim_matrix" "${junit[@]}" tests)
echo "torch-suite: torch $v passed in $((SECONDS - start)) s" >&2
