#!/usr/bin/env bash
# On a CUDA machine: run the given pytest paths in PARTS parallel processes (Triton compiles
# on the CPU, so tests that compile many kernel variants finish several times sooner).
#   PARTS=4 LOG=$OUT/tests.log scripts/gpu_tests_parallel.sh tests/kernels/test_kernels_gate.py ...
set -uo pipefail
PARTS="${PARTS:-4}"; LOG="${LOG:-/tmp/gpu_tests.log}"
dir=$(mktemp -d)
python3 -m pytest --collect-only -q -p no:cacheprovider "$@" 2>/dev/null | grep "::" > "$dir/ids"
split -n "r/$PARTS" "$dir/ids" "$dir/part."
for f in "$dir"/part.*; do
  OMP_NUM_THREADS=2 timeout "${PART_TIMEOUT:-600}" python3 -m pytest -q -p no:cacheprovider $(cat "$f") > "$f.log" 2>&1 &
done
wait
: > "$LOG"
for f in "$dir"/part.*.log; do
  grep -qE "passed|failed" "$f" || echo "$(basename "$f"): cut at ${PART_TIMEOUT:-600} s: $(tr -cd '.' < "$f" | wc -c) passed before" >> "$LOG"
  grep -E "passed|failed|error|FAILED|Error" "$f" >> "$LOG"
done
echo "$(wc -l < "$dir/ids") tests in $PARTS parts:"; grep -E "passed|failed|cut at" "$LOG" | grep -v FAILED
grep FAILED "$LOG" | head -5
