#!/bin/sh
# Runs a command as one rank of a simulated two-vendor job on CPU: the
# first half of the ranks are nvidia, the rest amd (GPUBRIDGE_VENDOR).
# For torchrun --no-python, e.g.:
#   torchrun --standalone --nproc-per-node 4 --no-python bench/sim_halves.sh \
#       python -m gpubridge.tune --write-thresholds t.json
set -eu
if [ "$RANK" -lt $((WORLD_SIZE / 2)) ]; then GPUBRIDGE_VENDOR=nvidia; else GPUBRIDGE_VENDOR=amd; fi
export GPUBRIDGE_VENDOR
exec "$@"
