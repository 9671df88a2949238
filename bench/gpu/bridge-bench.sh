#!/usr/bin/env bash
# The bridge on the GPU host's CPUs (issue 3): gbbridge selftest, then the
# benchmarks of bench/run.sh against torch Gloo and the ceilings, in one
# run. The Go binaries are built on the dev machine and carried in bin/;
# iperf3 comes as Debian packages carried in .devbuild/debs. Output in $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp/gpubridge-out}; mkdir -p "$out"
exec > >(tee -a "$out/bridge-bench.log") 2>&1
echo "== $(date -u +%FT%TZ) commit ${GB_COMMIT:-unknown}; $(nproc) cores"
if ls .devbuild/debs/*.deb >/dev/null 2>&1; then
  mkdir -p /tmp/iperf && for f in .devbuild/debs/*.deb; do dpkg -x "$f" /tmp/iperf; done
  export PATH=/tmp/iperf/usr/bin:$PATH LD_LIBRARY_PATH=/tmp/iperf/usr/lib/x86_64-linux-gnu
  iperf3 --version | head -1
fi
echo "== gbbridge selftest"
start=$(date +%s)
bin/gbbridge selftest > "$out/selftest.json" 2> "$out/selftest.err"; echo "selftest rc=$? in $(( $(date +%s) - start ))s"
grep '^selftest:' "$out/selftest.err"
echo "== benchmarks"
GB_ITERS=${GB_ITERS:-5} bench/run.sh "$out/bench" bin python3
python3 bench/report.py "$out/bench/rows.jsonl" "nvidia-h200-x2 host, $(nproc) cores" > "$out/report.md"
cat "$out/report.md"
(cd "$out" && tar czf bench.tgz bench && rm -rf bench)
