#!/usr/bin/env bash
# A shorter bench/gpu/bridge-bench.sh: the 2- and 4-member all_reduce over TCP
# and shm with 8 and 16 streams, their exchange ceilings and torch Gloo, in
# one run. Output in $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp/gpubridge-out}; mkdir -p "$out"
exec > >(tee -a "$out/bridge-bench-quick.log") 2>&1
echo "== $(date -u +%FT%TZ) commit ${GB_COMMIT:-unknown}; $(nproc) cores"
rows=$out/rows.jsonl; : > "$rows"
sizes=16M,64M,256M,1G
tag() { python3 bench/tag_rows.py "$1"; }  # rows of stdin, "config" set
b() { local cfg=$1; shift; echo "== $cfg" >&2; bin/gbbridge bench --json --iters 5 --warmup 1 --sizes "$sizes" "$@" 2>/dev/null | tag "$cfg" >> "$rows"; }
for s in 8 16; do
  b "tcp-exchange-s$s" --members 2 --transport tcp --streams "$s" --collective exchange
  b "tcp-allreduce-s$s" --members 2 --transport tcp --streams "$s"
  b "shm-exchange-s$s" --members 2 --transport shm --streams "$s" --collective exchange
  b "shm-allreduce-s$s" --members 2 --transport shm --streams "$s"
done
b tcp-allreduce-4m-s8 --members 4 --transport tcp --streams 8
b shm-allreduce-4m-s8 --members 4 --transport shm --streams 8
b memcpy --members 2 --transport shm --streams 4 --collective memcpy
for n in 2 4; do
  python3 bench/gloo_allreduce.py --members "$n" --sizes 16777216,67108864,268435456,1073741824 --iters 5 | tag "gloo-$n" >> "$rows"
done
python3 bench/report.py "$rows" "nvidia-h200-x2 host, $(nproc) cores, commit ${GB_COMMIT:-unknown}" > "$out/report.md"
cat "$out/report.md"
