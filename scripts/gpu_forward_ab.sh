#!/usr/bin/env bash
# On a CUDA machine: the model's forward before and after a change, in one run on one card. For each
# tree (BEFORE, a copy of the older commit, e.g. `git archive 1999331 | tar -x -C .before`, carried;
# and this tree): serving end to end (`condmem bench e2e`, 4B, host tables staged vs HBM, an A/A
# control), Hugging Face greedy generate with decode graphs vs the plain model, and the training
# step against its FLOPs-matched baseline. Each tool's JSON and log go to $OUT/{before,after}/; the
# summary lines of both trees print last, side by side in time; the files are packed in $OUT/forward_ab.tgz.
#
#   BEFORE=.before TABLE_GIB=40 scripts/gpu_forward_ab.sh      # 40 GiB fits beside the 4B on an H100
set -uo pipefail
# shellcheck disable=SC1091
source "$(dirname "$0")/_device_env.sh"
BEFORE="${BEFORE:?BEFORE: a folder holding the older tree (its src/ and benchmarks/)}"
TABLE_GIB="${TABLE_GIB:-40}"
site="${PYTHONPATH#src}"   # the carried wheels, if _device_env.sh installed them
run_tree() {  # name, tree
  local name=$1 tree=$2 out="$OUT/$1"
  mkdir -p "$out"
  (
    cd "$tree" || exit 1
    export PYTHONPATH="src$site"
    python3 -m condmem bench e2e --out "$out" --backbones 4b --table-gib "$TABLE_GIB" --sequences 128 --gen 64 \
      --e2e-repeats 2 --e2e-variants none hbm host_staged > "$out/bench_e2e.log" 2>&1
    python3 benchmarks/hf_generate_host.py --repeats 8 --new-tokens 32 --profile-steps 0 --out "$out" \
      > "$out/hf_generate.log" 2>&1
    python3 benchmarks/train_step_profile.py --out "$out" > "$out/train_step_profile.log" 2>&1
  )
}
run_tree "before" "$BEFORE"
run_tree "after" .
for name in before after; do
  echo "== $name"
  grep -E "^ +(model|4b) " "$OUT/$name/bench_e2e.log" | tail -n 5   # the e2e table: x hbm per phase, none_again = A/A
  tail -n 6 "$OUT/$name/hf_generate.log"
  grep -E "^(step|tokens/s)" "$OUT/$name/train_step_profile.log"
done
# One archive: a device call returns a handful of files, and both trees write seven each.
tar -C "$OUT" -czf "$OUT/forward_ab.tgz" before after && rm -rf "$OUT/before" "$OUT/after"
