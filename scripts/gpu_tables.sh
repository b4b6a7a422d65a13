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
# A hung test would hold the machine: with pytest-timeout (the device has it) a test
# running past 120 s is stopped, its threads' stacks in the log; without it faulthandler only
# dumps them; the suite gets 900 s in any case (SIGINT: pytest reports where it was).
per_test="-o faulthandler_timeout=120"
if python3 -c "import pytest_timeout" 2>/dev/null; then per_test="--timeout=120 --timeout-method=thread"; fi
# shellcheck disable=SC2086
timeout -s INT 900 python3 -m pytest -q -x -p no:cacheprovider $per_test \
  tests/kernels/test_kernels_gather.py tests/kernels/test_kernels_row_cache.py tests/tables tests/serving > "$OUT/tables_tests_full.log" 2>&1
tail -n 15 "$OUT/tables_tests_full.log" | tee "$OUT/tables_tests.log"
