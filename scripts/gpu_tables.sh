#!/usr/bin/env bash
# On a CUDA machine: `condmem bench lookup` (e.g. with a 64 GiB pinned host table), then GPU
# exactness tests of every lookup path (the gather and cache kernels, staged sends, tables,
# runtime). The bench runs first: on the H200, a bench started right after the test suite
# measured the host tier ~1.4x slower than the same bench on a quiet machine (cause not
# found). Writes logs + JSON + PNG to $OUT.
set -uo pipefail
# shellcheck disable=SC1091
source "$(dirname "$0")/_device_env.sh"
python3 -m condmem bench lookup --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_lookup.log"
# scripts/gpu_test stops a test that runs past TEST_TIMEOUT (pytest-timeout), its stacks in the log.
LOG="$OUT/tables_tests_full.log" TEST_TIMEOUT=120 "$(dirname "$0")/gpu_test" tests/kernels/test_kernels_gather.py \
  tests/kernels/test_kernels_row_cache.py tests/tables tests/serving | tee "$OUT/tables_tests.log"
