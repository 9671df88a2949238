#!/usr/bin/env bash
# The codec benchmarks (issue 13): lib/codec's Go benchmarks (fp8 and bf16
# encode, decode, decode-add of float32 with the AVX2 and the Go kernels,
# memcpy as the anchor of the same run; the lossless codec's plane methods
# against plain zstd) on gradient dumps of a small model (codec_grads.py),
# and gbcompress stat on the same dumps. Rows (docs/bench/*.jsonl) on
# stdout's last step: OUTDIR/rows.jsonl.
#
#   bench/codec.sh OUTDIR [PYTHON]      (PYTHON: with torch; default .venv/bin/python)
#
# About 5 minutes on the 2-core box. Speeds are per core: the benchmarks
# report MB/s of their own thread's CPU time (cpu-MB/s) beside wall-clock
# MB/s, so a loaded machine shows in the wall figures only.
set -euo pipefail
out=${1:?usage: bench/codec.sh OUTDIR [PYTHON]}
py=${2:-.venv/bin/python}
mkdir -p "$out/grads" "$out/bin"
commit=$(git rev-parse --short HEAD)
go build -trimpath -o "$out/bin/" ./tools/gbcompress
[ -e "$out/grads/grads-step40-f32.npy" ] || "$py" bench/codec_grads.py "$out/grads"
cat /proc/loadavg > "$out/load-before"
GPUBRIDGE_CODEC_DUMP="$out/grads" go test -run '^$' -bench 'BenchmarkMXFP8|BenchmarkBF16|BenchmarkLossless' \
  -benchtime 2s -count 1 -timeout 30m ./lib/codec | tee "$out/bench.txt"
"$out/bin/gbcompress" stat "$out"/grads/*-f32.npy > "$out/stat.jsonl"
"$out/bin/gbcompress" stat --dtype bf16 "$out"/grads/*-bf16.npy >> "$out/stat.jsonl"
cat /proc/loadavg > "$out/load-after"
"$py" bench/codec_rows.py "$out" "$commit" > "$out/rows.jsonl"
echo "rows: $out/rows.jsonl" >&2
