#!/usr/bin/env bash
# Study throughput on one GPU: a preset's pure-MoE run alone, then K of them at once (seeds 0..K-1,
# one process each), eager and compiled. Checks that the run of seed 0 gives the same losses alone and
# beside others (deterministic mode), and reports each run's training tokens/s and the sweep's
# tokens/s (all runs' tokens over the phase's wall time, process start and validation included).
#
#   OUT=/tmp/probe STEPS=150 K=3 PRESET=gpu benchmarks/probes/study_concurrency.sh
#
# Run from a tree whose src/ holds condmem (PYTHONPATH=src is set when unset).
set -uo pipefail
OUT="${OUT:-/tmp/study-concurrency}" STEPS="${STEPS:-150}" K="${K:-3}" PRESET="${PRESET:-gpu}"
VAL="${VAL:-262144}" MODES="${MODES:-eager compiled}"
export CONDMEM_CACHE_DIR="${CONDMEM_CACHE_DIR:-/tmp/condmem-cache}" PYTHONPATH="${PYTHONPATH:-src}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
preset="$(python3 -c "import condmem, pathlib; print(pathlib.Path(condmem.__file__).parent / 'configs/study/$PRESET.toml')")"
# the preset's own compile line (if any) replaced by the mode's; eager also drops the CUDA graphs
# (which replay compiled blocks), compiled keeps the preset's choice
sed -e '/^compile *=/d' -e '/^cuda_graphs *=/d' -e "s/^\[train\]\$/[train]\ncompile = false/" "$preset" > "$OUT/eager.toml"
sed -e '/^compile *=/d' -e "s/^\[train\]\$/[train]\ncompile = true/" "$preset" > "$OUT/compiled.toml"

study() {  # config out-dir only-filter steps
  python3 -m condmem study allocation --config "$1" --out "$2" --only "$3" --steps "$4" --seeds "$K" \
    --val-tokens "$VAL" --no-progress > "$2.log" 2>&1 || { echo "failed: $2 (log: $2.log)"; tail -5 "$2.log"; }
}
now() { date +%s.%N; }

t0=$(now); study "$OUT/eager.toml" "$OUT/prep" "rho=1.0,control=none,seed=0" 2; t1=$(now)
echo "data prepared (tokenizer, corpus, cache) in $(python3 -c "print(round($t1-$t0, 1))") s"
for mode in $MODES; do
  t0=$(now); study "$OUT/$mode.toml" "$OUT/$mode-alone" "rho=1.0,control=none,seed=0" "$STEPS"; t1=$(now)
  echo "$mode alone: $t1 - $t0" > "$OUT/$mode-alone.wall"
  t0=$(now)
  for ((s = 0; s < K; s++)); do study "$OUT/$mode.toml" "$OUT/$mode-k$s" "rho=1.0,control=none,seed=$s" "$STEPS" & done
  wait; t1=$(now)
  echo "$mode k$K: $t1 - $t0" > "$OUT/$mode-k.wall"
done

python3 - "$OUT" "$K" "$MODES" <<'EOF'
import glob, json, sys, torch
out, k, modes = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
def runs(pattern):
    return [json.load(open(p)) for p in sorted(glob.glob(f"{out}/{pattern}/runs/*.json"))]
def wall(name):
    a, b = open(f"{out}/{name}.wall").read().split(":")[1].split(" - ")
    return float(a) - float(b)
rows, result = [], {"card": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "k": k}
for mode in modes:
    alone = runs(f"{mode}-alone")[0]
    together = [r for s in range(k) for r in runs(f"{mode}-k{s}")]
    same = next(r for r in together if r["seed"] == 0)
    tokens = sum(r["train_tokens"] for r in together)
    entry = {
        "alone_tok_s": alone["tokens_per_s"], "alone_wall_s": wall(f"{mode}-alone"),
        "alone_sweep_tok_s": alone["train_tokens"] / wall(f"{mode}-alone"),
        "together_tok_s_each": [r["tokens_per_s"] for r in together], "together_wall_s": wall(f"{mode}-k"),
        "together_sweep_tok_s": tokens / wall(f"{mode}-k"),
        "seed0_val_loss_alone": alone["val_loss"], "seed0_val_loss_together": same["val_loss"],
        "seed0_losses_equal": alone["train_losses"] == same["train_losses"] and alone["val_loss"] == same["val_loss"],
    }
    result[mode] = entry
    rows.append((mode, entry))
json.dump(result, open(f"{out}/summary.json", "w"), indent=1)
print(f"card: {result['card']}  K={k}")
print(f"{'mode':10} {'alone tok/s':>12} {'alone sweep':>12} {f'K each tok/s':>14} {'K sweep tok/s':>14} {'gain':>6}  same losses")
for mode, e in rows:
    each = sum(e["together_tok_s_each"]) / len(e["together_tok_s_each"])
    gain = e["together_sweep_tok_s"] / e["alone_sweep_tok_s"]
    print(f"{mode:10} {e['alone_tok_s']:12,.0f} {e['alone_sweep_tok_s']:12,.0f} {each:14,.0f} "
          f"{e['together_sweep_tok_s']:14,.0f} {gain:6.2f}  {e['seed0_losses_equal']}")
EOF
