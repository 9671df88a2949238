#!/usr/bin/env bash
# ci/torch-suite.sh VERSION [JUNIT_XML]: the plugin's test suite
# (torchplugin/tests) on torch VERSION, in .venv-torch-VERSION (made by
# ci/torch-venv.sh), against the tools in bin/ (make build); JUNIT_XML gets
# pytest's JUnit report. Says how long it took.
#
# This run is for what changes with torch: the APIs the plugin uses (backend
# registration, Work and Future semantics, DDP's reducer and comm hooks,
# FSDP, isend/irecv and batch_isend_irecv, pipelining, torch.compile of the
# codec, torch's Flight Recorder read by gbtrace fr, init_process_group and
# its env:// store, torchrun, torch's arithmetic in the caller's reduction).
# The project's torch (make pytest) runs every test; here two markers leave
# out what would only run gpubridge's own logic again through torch calls
# that the tests kept here already make:
#   victim_matrix      a fault test's further victims (which rank died);
#   torch_independent  each marked test or case says why, in one line
#                      (tests/conftest.py refuses one without a reason).
# Kept on every torch: every backend, training, example, native, weighted,
# codec and compression job, the point-to-point pairs of 2+2, a killed rank
# under DDP and under FSDP and an exited one under DDP, the set-up failures
# whose store is torch's, torchrun start-up failures through the backend,
# torch's Flight Recorder, and every test that takes under a second. Together
# the two markers keep a loaded make test about 25 minutes shorter.
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
(cd torchplugin && GPUBRIDGE_BIN="$bin" "../.venv-torch-$v/bin/python" -m pytest -q -m "not victim_matrix and not torch_independent" "${junit[@]}" tests)
echo "torch-suite: torch $v passed in $((SECONDS - start)) s" >&2
