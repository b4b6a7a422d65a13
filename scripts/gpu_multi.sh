#!/usr/bin/env bash
# On a machine of several GPUs (NCCL, one GPU a rank): tensor-parallel Engram at every world size
# 2..N (rows exact against one process, each mode's collective time against the prediction),
# the reference decoder served with its tables sharded (logits checked against one process),
# and training with tables sharded over the GPUs: one global batch at 1 and N GPUs (losses
# compared), one per-GPU batch at 1..N GPUs (tokens/s against linear), a run killed and resumed
# against an uninterrupted one; then bench e2e at TP 1 and TP N in both row modes. Logs and JSON to
# $OUT, and all of it in multi_gpu.{json,png} (benchmarks/multi_gpu_report.py).
set -uo pipefail
# shellcheck disable=SC1091
source "$(dirname "$0")/_device_env.sh"
# NVLink multicast stays off: a program that uses it can take a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
N=$(nvidia-smi -L | wc -l)
STEPS="${STEPS:-30}"
PER_GPU_BATCH="${PER_GPU_BATCH:-16}"
for w in 2 4 8; do
  [ "$w" -le "$N" ] || continue
  torchrun --nproc-per-node "$w" benchmarks/multi_gpu_tp.py --out "$OUT/tp_w$w" > "$OUT/tp_w$w.log" 2>&1
  tail -n 7 "$OUT/tp_w$w.log"
done
torchrun --nproc-per-node "$N" examples/tp_engram.py --cuda > "$OUT/tp_engram_example.log" 2>&1
tail -n 3 "$OUT/tp_engram_example.log"
train() {  # world size, global batch, run name
  torchrun --nproc-per-node "$1" -m condmem train --preset gpu --steps "$STEPS" --set train.batch_size="$2" \
    --set data.max_train_bytes=20000000 --set train.eval_every=0 --set train.eval_tokens=65536 --no-progress \
    --out "$OUT/train_$3" \
    > "$OUT/train_$3.log" 2>&1
}
train 1 "$((PER_GPU_BATCH * N))" same_batch_w1
train "$N" "$((PER_GPU_BATCH * N))" same_batch_w"$N"
for w in 1 2 4 8; do
  [ "$w" -le "$N" ] || continue
  train "$w" "$((PER_GPU_BATCH * w))" per_gpu_w"$w"
done
# Kill and resume on N GPUs: a run killed (SIGKILL) after its step-10 checkpoint and resumed
# to step 20 against an uninterrupted 20-step run (losses compared step by step).
train_ckpt() {  # run name, extra args (a resumed run keeps its checkpoint's settings: --resume alone)
  if [ "${2:-}" = --resume ]; then set -- "$1" --resume --steps 20; else
    set -- "$1" --preset gpu --steps 20 --set train.batch_size="$((PER_GPU_BATCH * N))" \
      --set data.max_train_bytes=20000000 --set train.eval_every=0 --set train.eval_tokens=65536 \
      --set train.checkpoint_every=10; fi
  torchrun --nproc-per-node "$N" -m condmem train --no-progress --out "$OUT/train_$1" "${@:2}" >> "$OUT/train_$1.log" 2>&1
}
train_ckpt whole
train_ckpt killed & pid=$!
for _ in $(seq 600); do [ -f "$OUT/train_killed/checkpoints/LATEST" ] && grep -q 10 "$OUT/train_killed/checkpoints/LATEST" && break; sleep 1; done
pkill -KILL -f "train_killed" ; wait "$pid" 2>/dev/null
train_ckpt killed --resume
# Tensor-parallel serving: the backbone and the tables sharded over the N GPUs, each row mode.
E2E="--backbones 4b --table-gib 16 --sequences 256 --gen 128 --e2e-repeats 2 --e2e-variants none hbm host_prefetch host_staged"
python3 -m condmem bench e2e $E2E --out "$OUT/e2e_tp1" > "$OUT/e2e_tp1.log" 2>&1
for mode in head row; do
  torchrun --nproc-per-node "$N" -m condmem bench e2e $E2E --tp-mode "$mode" --out "$OUT/e2e_tp${N}_$mode" \
    > "$OUT/e2e_tp${N}_$mode.log" 2>&1
  tail -n 4 "$OUT/e2e_tp${N}_$mode.log"
done
# Everything above in one JSON and one PNG ($OUT/multi_gpu.{json,png}), a short table last.
python3 benchmarks/multi_gpu_report.py "$OUT" "$N"
