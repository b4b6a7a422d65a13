#!/usr/bin/env bash
# Device run for the tables issue: GPU exactness tests of every lookup path (the gather and
# cache kernels, tables, runtime), then
# `condmem bench lookup` with a 64 GiB pinned host table. Writes logs + JSON + PNG to $OUT.
set -uo pipefail
# shellcheck disable=SC1091
source "$(dirname "$0")/_device_env.sh"
python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_kernels_gather.py \
  tests/kernels/test_kernels_row_cache.py tests/tables tests/runtime 2>&1 | tail -n 15 | tee "$OUT/tables_tests.log"
python3 -m condmem bench lookup --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_lookup.log"
