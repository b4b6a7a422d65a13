#!/usr/bin/env bash
# Device run for the tables issue: GPU exactness tests of every lookup path, then
# `condmem bench lookup` with a 64 GiB pinned host table. Writes logs + JSON + PNG to $OUT.
set -uo pipefail
OUT="${OUT:-/tmp/condmem-out}"; mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=src:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pytest -q -x -p no:cacheprovider tests/tables 2>&1 | tail -n 15 | tee "$OUT/tables_tests.log"
python3 -m condmem bench lookup --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_lookup.log"
