#!/usr/bin/env bash
# On a CUDA machine: the lookup engine's non-regression check. `condmem bench lookup` (HBM and a
# 64 GiB page-locked host table, decode and 16K-token batches, text + 10% cache and uniform ids,
# two rounds), then the GPU tests of kernels, tables and runtime, then the burst test that once
# spoiled a graph capture, 50 times. Logs and JSON to $OUT; the summaries are printed last.
set -uo pipefail
# shellcheck disable=SC1091
source "$(dirname "$0")/_device_env.sh"
python3 -m condmem bench lookup --tiers hbm host --streams text uniform --table-gib 64 --hbm-gib 16 \
  --batch-tokens 1 64 256 16384 --repeats 3 --rounds 2 --out "$OUT" > "$OUT/bench_lookup.log" 2>&1
LOG="$OUT/gpu_tests.log" "$(dirname "$0")/gpu_test" tests/kernels tests/tables tests/serving | tail -n 3
CONDMEM_BURST_REPEATS=50 LOG="$OUT/burst50.log" "$(dirname "$0")/gpu_test" tests/tables/test_lookup.py \
  -k bad_ids_amid_a_burst | tail -n 2
grep -v "^\s*$" "$OUT/bench_lookup.log" | tail -n 22
