#!/usr/bin/env bash
# On a CUDA machine: what bounds the host tier's CPU row gather (benchmarks/probes/cpu_gather_probe.py).
set -uo pipefail
# shellcheck disable=SC1091
source "$(dirname "$0")/_device_env.sh"
python3 -X faulthandler benchmarks/probes/cpu_gather_probe.py "$@" 2>&1 | tee "$OUT/cpu_gather_probe.log"
