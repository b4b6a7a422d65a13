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
timeout -s INT "${TEST_TIMEOUT:-240}" python3 -m pytest -q -x -p no:cacheprovider \
  tests/kernels tests/tables tests/serving > "$OUT/gpu_tests.log" 2>&1
CONDMEM_BURST_REPEATS=50 timeout -s INT 180 python3 -m pytest -q -p no:cacheprovider \
  tests/tables/test_lookup.py -k bad_ids_amid_a_burst > "$OUT/burst50.log" 2>&1
tail -n 3 "$OUT/gpu_tests.log"
tail -n 2 "$OUT/burst50.log"
grep -v "^\s*$" "$OUT/bench_lookup.log" | tail -n 22
