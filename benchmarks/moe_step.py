"""MoE training step against a dense model with the same active parameters, and the study's sweep times.

On the `condmem study` gpu preset's backbone (dim 512, 6 blocks, 62 routed experts of width
256, top-2, a shared expert of width 512; batch 64 x 512 tokens, bf16 autocast), trained by
the library's own `Trainer` on random tokens:

* ``dense``: the same blocks with one SwiGLU of width 512 + 2 x 256 = 1024 (the active
  width of the MoE: same active parameters and FLOPs per token, routers aside);
* ``moe``: the routed experts through `torch._grouped_mm` (the default on sm90+);
* ``moe_loop``: the same model, one matmul per expert (the fallback), to show what grouping buys;
* ``moe_engram_rho0.2``: the allocation sweep's lowest rho (14 experts, ~3.5M table rows);
* ``moe_engram_big``: the slot sweep's largest point (62 experts, ~40M table rows).

First it checks one MoE layer: grouped GEMM and per-expert loop agree (outputs and every
gradient, bf16 tolerance) and both match an fp32 run. Then each variant trains 3 untimed
and ``--steps`` timed steps. The target: ``moe`` within 1.5x of ``dense``. From the
measured rates it estimates each sweep's minutes (steps x tokens / rate + evaluation +
data preparation). Writes ``moe_step.json`` under ``--out`` and prints a table last.

    PYTHONPATH=src python3 benchmarks/moe_step.py --out $OUT
    PYTHONPATH=src python3 benchmarks/moe_step.py --device cpu --tiny   # smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from condmem.config import EngramConfig
from condmem.utils.code_version import short_commit
from condmem.models import DecoderLM
from condmem.models.config import ModelConfig
from condmem.models.moe import MoE
from condmem.train.data import TokenStream
from condmem.train.loop import TrainConfig, Trainer
from condmem.apps.study.sweep import STUDY_PRESETS, allocation_points, slot_points

VOCAB = 8192


def commit() -> str:
    """The running code's commit, short (``+dirty`` for changed tracked files), or "unknown"."""
    return short_commit() or "unknown"


def check_layer(device: torch.device, tiny: bool) -> dict:
    """One MoE layer: grouped GEMM vs per-expert loop (bf16 autocast) vs the loop in fp32."""
    dim, experts, hidden, tokens = (32, 6, 16, 64) if tiny else (512, 62, 256, 32768)
    torch.manual_seed(0)
    layers = {name: MoE(dim, experts, 2, hidden).to(device) for name in ("grouped", "loop", "fp32")}
    for name in ("loop", "fp32"):
        layers[name].load_state_dict(layers["grouped"].state_dict())
    layers["grouped"].use_grouped_mm = device.type == "cuda"
    layers["loop"].use_grouped_mm = layers["fp32"].use_grouped_mm = False
    x = torch.randn(tokens, dim, device=device)
    out = {}
    for name, layer in layers.items():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=name != "fp32"):
            y = layer(x)
        y.float().square().mean().backward()
        out[name] = [y.detach().float()] + [layer.get_parameter(p).grad.float() for p in ("router.weight", "w13", "w2")]

    def rel(a, b):
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    names = ("output", "grad router", "grad w13", "grad w2")
    result = {
        "grouped_vs_loop": dict(zip(names, map(rel, out["grouped"], out["loop"]))),
        "loop_vs_fp32": dict(zip(names, map(rel, out["loop"], out["fp32"]))),
        "grouped_mm_used": layers["grouped"].use_grouped_mm,
    }
    result["ok"] = all(v < 2e-2 for v in result["grouped_vs_loop"].values()) and all(
        v < 5e-2 for v in result["loop_vs_fp32"].values()
    )
    return result


def variants(tiny: bool) -> dict[str, ModelConfig]:
    sp = STUDY_PRESETS["tiny" if tiny else "gpu"]
    m = sp.base.model
    e = sp.base.engram
    engram = EngramConfig(
        layer_ids=e.layer_ids,
        max_ngram_size=e.max_ngram_size,
        n_heads=e.n_heads,
        head_dim=e.head_dim,
        table_size=e.table_size,
        pad_id=1,
        hidden_size=m.dim,
        hc_mult=1,
        compressed_vocab_size=VOCAB,
    )
    base = ModelConfig(vocab_size=VOCAB, engram=engram, engram_table_init_std=e.table_init_std, **dataclasses.asdict(m))
    allocation = allocation_points(base, sp.rhos)
    slots = slot_points(base, sp.table_sizes)
    moe = allocation[0].cfg
    active = m.ffn_hidden + m.moe.top_k * m.moe.expert_hidden
    dense = moe.replace(moe=None, ffn_hidden=[w - m.ffn_hidden + active for w in moe.ffn_hidden])
    return {
        "dense": dense,
        "moe": moe,
        "moe_loop": moe,
        f"moe_engram_rho{allocation[-1].rho}": allocation[-1].cfg,
        "moe_engram_big": slots[-1].cfg,
    }


def time_variant(name: str, cfg: ModelConfig, device: torch.device, steps: int, tc: TrainConfig) -> dict:
    rng = np.random.default_rng(0)
    train = TokenStream(rng.integers(2, VOCAB, size=tc.batch_size * tc.seq_len * (steps + 4) + 1).astype(np.int32), 0)
    val = TokenStream(rng.integers(2, VOCAB, size=4 * tc.seq_len + 1).astype(np.int32), 0)
    t0 = time.perf_counter()
    model = DecoderLM(cfg, token_lookup=np.arange(VOCAB, dtype=np.int64), seed=0, device=device)
    if name == "moe_loop":
        for block in model.blocks:
            block.moe.use_grouped_mm = False
    build_s = time.perf_counter() - t0
    run = dataclasses.replace(tc, steps=steps + 3, warmup_steps=2, log_every=10**6, eval_tokens=tc.seq_len)
    trainer = Trainer(model, run, train, val, np.ones(VOCAB, dtype=np.int64), device, label=name, progress=False)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    summary = trainer.fit()
    counts = model.param_counts()
    out = {
        "tokens_per_s": summary["tokens_per_s"],
        "ms_per_step": 1e3 * tc.batch_size * tc.seq_len / max(summary["tokens_per_s"], 1e-9),
        "build_s": build_s,
        "params": counts,
        "final_train_loss": summary["final_train_loss"],
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }
    del trainer, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def estimates(rows: dict, tiny: bool) -> dict:
    """Minutes of each gpu-preset sweep from the measured rates (eval ~2M tokens at ~3x the training rate)."""
    sp = STUDY_PRESETS["tiny" if tiny else "gpu"]
    tokens = sp.base.train.batch_size * sp.base.train.seq_len
    engram = next(v for k, v in rows.items() if k.startswith("moe_engram_rho"))
    per_run = {"moe": rows["moe"], "engram": engram}
    val_tokens, prep_s, overhead_s = 2.1e6, 60.0, 3.0

    def run_s(rate, steps):
        return steps * tokens / rate + val_tokens / (3 * rate) + overhead_s

    n = len(sp.rhos)
    alloc = 2 * (
        run_s(per_run["moe"]["tokens_per_s"], sp.allocation_steps)
        + (n - 1) * run_s(per_run["engram"]["tokens_per_s"], sp.allocation_steps)
    )
    slots = run_s(per_run["moe"]["tokens_per_s"], sp.slots_steps) + len(sp.table_sizes) * run_s(
        rows["moe_engram_big"]["tokens_per_s"], sp.slots_steps
    )
    return {
        "allocation_2_seeds_min": (alloc + prep_s) / 60,
        "slots_min": (slots + prep_s) / 60,
        "assumed": {"val_tokens": val_tokens, "data_prep_s_first_time": prep_s, "overhead_s_per_run": overhead_s},
        "budget_min": sp.minutes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    ap.add_argument("--tiny", action="store_true", help="the tiny preset's sizes (a smoke run on the CPU)")
    args = ap.parse_args()
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "commit": commit(),
        "torch": torch.__version__,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    result["layer_check"] = check_layer(device, args.tiny)
    print(f"layer check: {json.dumps(result['layer_check'])}", flush=True)
    tc = STUDY_PRESETS["tiny" if args.tiny else "gpu"].base.train
    rows = {}
    for name, cfg in variants(args.tiny).items():
        rows[name] = time_variant(name, cfg, device, args.steps, tc)
        print(f"{name}: {rows[name]['ms_per_step']:.1f} ms/step, {rows[name]['tokens_per_s']:,.0f} tok/s", flush=True)
    result["variants"] = rows
    result["moe_over_dense"] = rows["dense"]["tokens_per_s"] / rows["moe"]["tokens_per_s"]
    result["target_met"] = result["moe_over_dense"] <= 1.5
    result["sweep_estimates"] = estimates(rows, args.tiny)
    (out / "moe_step.json").write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"\n{'variant':<22} {'ms/step':>8} {'tok/s':>11} {'vs dense':>9} {'active':>12} {'total':>14} {'peak GiB':>9}"
    )
    for name, r in rows.items():
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        print(
            f"{name:<22} {r['ms_per_step']:>8.1f} {r['tokens_per_s']:>11,.0f} "
            f"{rows['dense']['tokens_per_s'] / r['tokens_per_s']:>8.2f}x {r['params']['active']:>12,} "
            f"{r['params']['total']:>14,} {peak:>9}"
        )
    est = result["sweep_estimates"]
    print(
        f"layer check {'ok' if result['layer_check']['ok'] else 'FAILED'}; MoE step {result['moe_over_dense']:.2f}x "
        f"dense (target <= 1.5: {'met' if result['target_met'] else 'NOT met'}); estimated sweeps: allocation "
        f"(2 seeds) {est['allocation_2_seeds_min']:.1f} min, slots {est['slots_min']:.1f} min "
        f"(budget {est['budget_min']} min each)"
    )


if __name__ == "__main__":
    main()
