#!/usr/bin/env bash
# On a CUDA machine: GPU kernel tests (incl. full DeepSeek-V4.1-Flash geometry),
# then every kernel benchmark. Logs and JSON rows go to $OUT (default benchmarks/results); a short
# table is printed last.  Usage:  OUT=/tmp/out scripts/gpu_kernels.sh [--no-tests] [--no-bench]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
run_tests=1; run_bench=1
for a in "$@"; do
  case "$a" in --no-tests) run_tests=0 ;; --no-bench) run_bench=0 ;; esac
done
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,memory.total --format=csv
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/gpu_run.log"
status=0
if [ "$run_tests" = 1 ]; then
  # The kernel tests through scripts/gpu_test (parallel workers; the whole-GPU ones alone after).
  T0=$(date +%s)
  LOG="$OUT/tests.log" PYTHON="$PY" scripts/gpu_test tests/kernels tests/test_hashing.py tests/test_module.py \
      | tee -a "$OUT/gpu_run.log" || status=1
  echo "tests: $(( $(date +%s) - T0 )) s" | tee -a "$OUT/gpu_run.log"
fi
if [ "$run_bench" = 1 ]; then
  T0=$(date +%s)
  # Through the bench module's own entry point: the other subcommands' imports stay out of it.
  timeout 200 "$PY" -m condmem.cli.bench all --variants --out "$OUT" 2>&1 | tee "$OUT/bench.log" || status=1
  echo "bench: $(( $(date +%s) - T0 )) s" | tee -a "$OUT/gpu_run.log"
fi
exit $status
