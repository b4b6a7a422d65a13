#!/usr/bin/env bash
# On a CUDA machine: a synthetic released-format V4.1 layer (the largest the disk allows, >= 32 GiB)
# loaded by EngramMemory.from_released into page-locked host memory and served with exact
# rows; load time and huge-page coverage in $OUT/released_load_h200.json (log beside it).
set -uo pipefail
# shellcheck disable=SC1091
source "$(dirname "$0")/_device_env.sh"
df -h . /tmp | tee "$OUT/released_load_h200.log"
python3 benchmarks/released_load_h200.py --out "$OUT" "$@" 2>&1 | tee -a "$OUT/released_load_h200.log"
