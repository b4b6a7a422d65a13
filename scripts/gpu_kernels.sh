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
  # Small-shape kernel tests in parallel (compilation dominates), then the full-geometry ones alone
  # (one of them fills 101 GB of HBM with a whole V4.1 layer table).
  T0=$(date +%s)
  timeout 200 "$PY" -m pytest -q -p no:cacheprovider -n 8 -k "not v41" tests/kernels tests/tables/test_quant.py \
      tests/test_hashing.py tests/test_module.py > "$OUT/tests.log" 2>&1 || status=1
  tail -15 "$OUT/tests.log" | tee -a "$OUT/gpu_run.log"
  timeout 150 "$PY" -m pytest -q -p no:cacheprovider -rs --durations=6 -k "v41" tests/kernels > "$OUT/tests_v41.log" 2>&1 \
      || status=1
  tail -12 "$OUT/tests_v41.log" | tee -a "$OUT/gpu_run.log"
  echo "tests: $(( $(date +%s) - T0 )) s" | tee -a "$OUT/gpu_run.log"
fi
if [ "$run_bench" = 1 ]; then
  T0=$(date +%s)
  # Through the bench module's own entry point: the other subcommands' imports stay out of it.
  timeout 200 "$PY" -m condmem.cli.bench all --variants --out "$OUT" 2>&1 | tee "$OUT/bench.log" || status=1
  echo "bench: $(( $(date +%s) - T0 )) s" | tee -a "$OUT/gpu_run.log"
fi
exit $status
