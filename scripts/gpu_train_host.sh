#!/usr/bin/env bash
# On a CUDA machine: the host-resident training tables' GPU tests, then
# benchmarks/train_host_table.py (hbm / host / host_device_adam on the same
# batches, and the >= 60 GiB host_big run; arguments passed through). Logs and JSON to $OUT;
# the last lines are the bench's table.
set -uo pipefail
# shellcheck disable=SC1091
source "$(dirname "$0")/_device_env.sh"
LOG="$OUT/train_host_gpu_tests.log" scripts/gpu_test tests/train/test_host_table.py 2>&1 | tail -n 3
python3 benchmarks/train_host_table.py --out "$OUT" "$@" > "$OUT/train_host_table.log" 2>&1
grep -i "error\|Traceback" "$OUT/train_host_table.log" | head -5
tail -n 8 "$OUT/train_host_table.log"
