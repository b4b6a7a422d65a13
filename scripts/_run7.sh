source scripts/_device_env.sh
timeout -s ABRT 240 python3 -X faulthandler -m condmem bench lookup --out "$OUT" --tiers host --streams text uniform --table-gib 64 --batch-tokens 16384 --repeats 3 --engines graphs+caller graphs --engine-rounds 3 --diagnostics pipeline --pipeline-fractions 1.0 > "$OUT/bench_lookup.log" 2>&1; echo "bench rc $?"
per_test="-o faulthandler_timeout=120"
if python3 -c "import pytest_timeout" 2>/dev/null; then per_test="--timeout=120 --timeout-method=thread"; fi
timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider $per_test tests/tables/test_lookup.py tests/test_capture_guard.py tests/runtime > "$OUT/gpu_tests.log" 2>&1; echo "tests rc $?"
tail -3 "$OUT/gpu_tests.log"
grep "lookups in" "$OUT/bench_lookup.log" | cut -c30-200
grep -E "^ +host +(text|uniform) +(latency|pipelined)" "$OUT/bench_lookup.log"
