#!/usr/bin/env bash
# On a CUDA machine: GPU tests of the paged attention kernels and the serving paths, one decode
# step against its bytes bound (kernel breakdown), then `condmem bench e2e` (arguments passed
# through). Logs and JSON to $OUT; the last lines are the bench's table.
set -uo pipefail
# shellcheck disable=SC1091
source "$(dirname "$0")/_device_env.sh"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # shellcheck disable=SC2086
  LOG="$OUT/paged_gpu_tests.log" "$(dirname "$0")/gpu_test" ${TESTS:-tests/kernels/test_kernels_attention.py \
    tests/serving tests/models} | tail -n 4
fi
if [ "${SKIP_PROFILE:-0}" != 1 ]; then
  timeout 120 python3 benchmarks/decode_step_profile.py --backbone 4b > "$OUT/decode_step_4b.log" 2>&1
  tail -n 30 "$OUT/decode_step_4b.log"
fi
python3 -m condmem bench e2e --out "$OUT" "$@" > "$OUT/bench_e2e.log" 2>&1
grep -v "^\s*$" "$OUT/bench_e2e.log" | grep -i "error\|Traceback" | head -5
tail -n 14 "$OUT/bench_e2e.log"
