#!/usr/bin/env bash
# On a CUDA machine: one device call's share of the study's GPU runs (docs/study-guide.md, "The GPU
# runs, where they stand"). Each sweep resumes in its folder under benchmarks/results/, $PARALLEL runs at once (default 5), and starts no
# run that would end after the call's time; a sweep starts once the one before it is complete. The
# folders are packed into $OUT/study.tgz (a device call returns a handful of files): unpack it in the
# repository root and call again with the folders carried, until every sweep has its study.json.
#
#   LIMIT=540 scripts/gpu_study.sh     # seconds this call may spend; the log is $OUT/study.log
#
# In order: once, one committed allocation run trained again (are its losses the committed ones?);
# the allocation at 100 and at 400 steps; the token axis, whose 100- and 400-step budgets are
# copied from the two allocation sweeps (--reuse); the slot sweep; then, once each on any card, the
# compiled step's CUDA kernels (pure MoE and dense, profiled), the training step's speed A/B (eager,
# compiled, queued steps, CUDA graphs; pure MoE, rho 0.8, dense; each variant from empty compiler
# caches), the kernels by family with graphs, the compiled step without deterministic mode, the
# ops that launch each kernel of the compiled step (--sources), and a
# sweep's tokens over wall time, one eager run at a time against $PARALLEL compiled runs at once
# (benchmarks/probes/study_concurrency.sh, 400 steps), all into benchmarks/results/.
set -uo pipefail
# shellcheck disable=SC1091
source "$(dirname "$0")/_device_env.sh"
export CONDMEM_CACHE_DIR="${CONDMEM_CACHE_DIR:-/tmp/condmem-cache}"
LIMIT="${LIMIT:-540}"
PARALLEL="${PARALLEL:-5}"  # runs at once: short compiled runs are bound by compiling, on the CPU
# the card (h100, h200), in the names of the probes this call writes (the sweeps keep the folders they began in)
CARD="${CARD:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o 'H[0-9][0-9]*' | head -1 | tr H h)}"
CARD="${CARD:-h100}"
T0=$(date +%s)
R=benchmarks/results
previous_done=1
left() { echo $((LIMIT - ($(date +%s) - T0))); }  # seconds this call has left
sweep() {  # kind, folder, flags...: resume it while this call has time, after the one before is complete
  local kind=$1 out=$2 left minutes need=120
  shift 2
  left=$(left)
  # a sweep with no finished run cannot tell how long one takes, so it would start runs that the
  # call's timeout then kills: give its first wave (5-7 runs of 1,000 steps at once) the time it needs
  compgen -G "$out/runs/*.json" > /dev/null || need=450
  if [ "$previous_done" -eq 1 ] && [ "$left" -ge "$need" ] && [ ! -f "$out/study.json" ]; then
    minutes=$(python3 -c "print(round(($left - 60) / 60, 2))")
    echo "== $kind -> $out (--stop-after $minutes)" | tee -a "$OUT/study.log"
    timeout "$left" python3 -m condmem study "$kind" --preset gpu --parallel "$PARALLEL" --stop-after "$minutes" \
      --no-progress --out "$out" "$@" >> "$OUT/study.log" 2>&1
    tail -n 2 "$OUT/study.log"
  fi
  [ -f "$out/study.json" ] || previous_done=0
}
if [ ! -f "$R/study_repro_h100.log" ] && [ "$(left)" -ge 240 ]; then
  echo "== a committed run trained again" | tee -a "$OUT/study.log"
  timeout 220 python3 -m condmem study allocation --preset gpu --out /tmp/repro --only run=rho1_seed0 --no-progress \
    >> "$OUT/study.log" 2>&1
  python3 - "$R" > /tmp/repro.txt <<'PY' && mv /tmp/repro.txt "$R/study_repro_h100.log"
import json, sys
committed = json.load(open(f"{sys.argv[1]}/study_allocation_h100/runs/rho1_seed0.json"))
again = json.load(open("/tmp/repro/runs/rho1_seed0.json"))
same = [a == b for a, b in zip(committed["train_losses"], again["train_losses"])]
first = same.index(False) + 1 if False in same else None
print(f"rho1_seed0 trained again: per-step losses {'bit-identical' if first is None else f'differ from step {first}'}; "
      f"validation {committed['val_loss']:.6f} committed, {again['val_loss']:.6f} again")
PY
  cat "$R/study_repro_h100.log"
fi
sweep allocation "$R/study_allocation_100steps_h100" --steps 100
sweep allocation "$R/study_allocation_400steps_h100"
sweep tokens "$R/study_tokens_h100" --reuse "$R/study_allocation_400steps_h100" "$R/study_allocation_100steps_h100"
sweep slots "$R/study_slots_h100"
ran() {  # name, extension: whether $R/<name>_<card>.<extension> exists for some card (each runs once)
  compgen -G "$R/$1_h[0-9]*.$2" > /dev/null
}
probe() {  # name, seconds (needed, and its timeout), what it measures, study_step_profile.py flags...:
  # once on any card, after the sweeps, into $R/<name>_$CARD.{json,log}
  local name=$1 seconds=$2 what=$3
  shift 3
  if [ "$previous_done" -eq 1 ] && ! ran "$name" json && [ "$(left)" -ge "$seconds" ]; then
    echo "== $what" | tee -a "$OUT/study.log"
    timeout "$seconds" python3 benchmarks/probes/study_step_profile.py "$@" --out "$OUT/$name" \
      > "$R/${name}_$CARD.log" 2>&1
    cp "$OUT/$name/study_step_profile.json" "$R/${name}_$CARD.json" 2>/dev/null
    tail -n 20 "$R/${name}_$CARD.log"
  fi
}
probe study_step_kernels 200 "the compiled step's kernels: pure MoE against dense" \
  --deterministic --models moe dense --options compiled_queued --steps 10 --profile
probe study_step_fresh 300 "speed A/B" --deterministic --models dense moe moe_engram_rho0.8 \
  --options eager compiled compiled_queued compiled_graphs --steps 30
probe study_step_kernel_kinds 180 "the step's kernels by family, without and with CUDA graphs: pure MoE against dense" \
  --deterministic --models moe dense --options compiled_queued compiled_graphs --steps 10 --profile
probe study_step_nondeterministic 120 "what deterministic mode costs: the graphs A/B's compiled steps, without it" \
  --models dense moe --options compiled_graphs --steps 30
probe study_step_sources 240 "which op launched each kernel (compiled, no graphs): pure MoE and rho 0.8" \
  --deterministic --models moe moe_engram_rho0.8 --options compiled --steps 10 --profile --sources
if [ "$previous_done" -eq 1 ] && ! ran "study_concurrency_k$PARALLEL" json && [ "$(left)" -ge 420 ]; then
  echo "== a sweep's throughput: one eager run at a time against $PARALLEL compiled at once" | tee -a "$OUT/study.log"
  OUT=/tmp/concurrency STEPS=400 K="$PARALLEL" timeout 400 benchmarks/probes/study_concurrency.sh \
    > "$R/study_concurrency_k${PARALLEL}_$CARD.log" 2>&1 && cp /tmp/concurrency/summary.json "$R/study_concurrency_k${PARALLEL}_$CARD.json"
  tail -n 4 "$R/study_concurrency_k${PARALLEL}_$CARD.log"
fi
mapfile -t folders < <(ls -d "$R"/study_*_h100 "$R"/study_*_h100.* "$R"/study_*_"$CARD" "$R"/study_*_"$CARD".* 2>/dev/null | sort -u)
tar -czf "$OUT/study.tgz" "${folders[@]}"
echo "packed: ${folders[*]} -> $OUT/study.tgz ($(( $(date +%s) - T0 )) s)"
