#!/usr/bin/env bash
# On a CUDA machine: training with the Engram tables in host memory (Adam on the device) against
# tables in HBM. The host tier's GPU tests first (through scripts/gpu_test), then the step profile
# against the FLOPs-matched baseline with the worker's default threads and with 8, then >= 60 GiB
# of table + Adam state against HBM tables in alternating rounds (benchmarks/train_host_table.py).
# Logs and JSON to $OUT (few files); each result's table last. Knobs: SKIP_TESTS=1 (the whole suite ran
# already), THREADS (the worker thread counts profiled, default "default 8").
set -uo pipefail
# shellcheck disable=SC1091
source "$(dirname "$0")/_device_env.sh"
[ "${SKIP_TESTS:-0}" = 1 ] || LOG="$OUT/host_tier_gpu_tests.log" scripts/gpu_test tests/kernels/test_kernels_row_patch.py \
  tests/train/test_train_fast_paths.py tests/train/test_host_table.py tests/train/test_sparse_adam_fused.py \
  2>&1 | tail -n 4
for threads in ${THREADS:-default 8}; do
  arg=(); [ "$threads" != default ] && arg=(--threads "$threads")
  tmp="$(mktemp -d)"
  timeout 240 python3 benchmarks/train_step_profile.py --out "$tmp" --tier host --adam device --steps 10 \
    "${arg[@]}" > "$OUT/profile_host_threads_$threads.log" 2>&1
  cp "$tmp/train_step_profile.json" "$OUT/profile_host_threads_$threads.json" 2>/dev/null
  echo "== host tier profile, worker threads $threads"
  grep -E "Error|Traceback" "$OUT/profile_host_threads_$threads.log" | head -3
  grep -E "^(step|forward: gather|backward|clip|optimizer|other|host )|tokens/s" "$OUT/profile_host_threads_$threads.log"
done
tmp="$(mktemp -d)"
timeout 300 python3 benchmarks/train_host_table.py --out "$tmp" --steps 200 --max-setup-s 60 --threads 16 \
  --rounds 3 --modes hbm --big-adam device > "$OUT/train_host_table_big.log" 2>&1
cp "$tmp/train_host_table.json" "$OUT/train_host_table_big.json" 2>/dev/null
grep -E "Error|Traceback|huge pages" "$OUT/train_host_table_big.log" | head -8
tail -n 4 "$OUT/train_host_table_big.log"
