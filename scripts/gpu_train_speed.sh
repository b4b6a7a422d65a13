#!/usr/bin/env bash
# On a CUDA machine: the training fast paths' GPU tests (through scripts/gpu_test), then where an
# Engram training step's time goes against the FLOPs-matched baseline (benchmarks/train_step_profile.py):
# the gpu preset with its tables in HBM (with the top kernels), a >= 4 GiB table in HBM, and the
# tables in host memory (Adam on the device). Logs and JSON to $OUT; each profile's table last.
set -uo pipefail
# shellcheck disable=SC1091
source "$(dirname "$0")/_device_env.sh"
LOG="$OUT/train_speed_gpu_tests.log" scripts/gpu_test tests/kernels/test_kernels_row_grad.py \
  tests/train/test_train_fast_paths.py tests/train/test_optim.py tests/train/test_host_table.py \
  tests/train/test_sparse_adam_fused.py tests/kernels/test_kernels_compile.py 2>&1 | tail -n 4
profile() {  # name, then arguments of train_step_profile.py
  local name=$1; shift
  mkdir -p "$OUT/$name"
  python3 benchmarks/train_step_profile.py --out "$OUT/$name" "$@" > "$OUT/$name/train_step_profile.log" 2>&1
  echo "== $name: $*"; grep -E "Error|Traceback" "$OUT/$name/train_step_profile.log" | head -3
  grep -E "^(step|clip|optimizer|other|forward: (hash|gather)|backward: table|host tier|tokens/s)" \
    "$OUT/$name/train_step_profile.log"
}
profile hbm --trace
profile hbm_5gib --table-size 2500000
profile host --tier host --steps 10 --trace
python3 benchmarks/sparse_adam_step.py --out "$OUT" > "$OUT/sparse_adam_step.log" 2>&1; tail -n 8 "$OUT/sparse_adam_step.log"
