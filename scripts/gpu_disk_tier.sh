#!/usr/bin/env bash
# On a CUDA machine: the disk tier end to end. `condmem bench lookup --tiers disk` (a file of
# DISK_GIB read with O_DIRECT behind a DRAM row cache: the device's random-read rate probed
# first, uniform ids cold, the text stream in steady state), then `condmem bench e2e` with the
# table on disk against the same decode path from host memory, then the GPU tests of the fetch
# timing and the scheduler's lookahead. The file goes to DISK_DIR (default: the temp folder).
# Logs and JSON to $OUT; the summaries are printed last.
set -uo pipefail
# shellcheck disable=SC1091
source "$(dirname "$0")/_device_env.sh"
DISK_GIB="${DISK_GIB:-40}"
DISK_DIR="${DISK_DIR:-/tmp}"
python3 -m condmem bench lookup --tiers disk --disk-gib "$DISK_GIB" --dram-cache-gib 4 --disk-dir "$DISK_DIR" \
  --streams uniform text --batch-tokens 1 16 256 16384 --repeats 3 --text-batches 20 --text-warmup 20 \
  --out "$OUT" > "$OUT/bench_lookup_disk.log" 2>&1
python3 -m condmem bench e2e --backbones 4b --e2e-variants host_eager disk_prefetch --table-gib 16 \
  --disk-dir "$DISK_DIR" --dram-cache-gib 4 --sequences 128 --gen 128 --e2e-repeats 1 --measure-fetch \
  --out "$OUT" > "$OUT/bench_e2e_disk.log" 2>&1
LOG="$OUT/gpu_tests_disk_tier.log" "$(dirname "$0")/gpu_test" tests/serving/test_memory.py \
  tests/serving/test_scheduler.py tests/tables/test_lookup.py -k "fetch_timing or lookahead or cpu_path or warm" | tail -n 2
grep -v "^\s*$" "$OUT/bench_lookup_disk.log" | tail -n 12
tail -n 5 "$OUT/bench_e2e_disk.log"
