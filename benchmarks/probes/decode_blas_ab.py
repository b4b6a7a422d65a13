"""A/B: the decode step's GEMMs captured from cuBLAS or cuBLASLt (`GraphedDecoder`'s
``DECODE_BLAS``), in a graph-captured step.

Both variants are `GraphedDecoder`s over the same cache (random keys and values), captured
with ``condmem.models.graphs.DECODE_BLAS`` naming the library; alternating rounds
of ``--steps`` steps each (CUDA events, median). The logits of one step are compared (the
libraries may sum in another order: bf16 rounding). Prediction before the first run:
cuBLASLt 0.5-1% faster (one 4-round run at b8b9223: 5.485 vs 5.523 ms, rounds mixed).

    PYTHONPATH=src python3 benchmarks/probes/decode_blas_ab.py --backbone 4b --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from condmem.bench.e2e import BACKBONES, step_weight_bytes
from condmem.bench.harness import copy_bandwidth_gbps, event_times_ms, machine_info
import condmem.models.graphs as graphs_module
from condmem.models.config import ModelConfig
from condmem.models.graphs import GraphedDecoder
from condmem.models.serving import ServingCache
from condmem.models.transformer import DecoderLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".")
    p.add_argument("--backbone", default="4b", choices=sorted(BACKBONES))
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth_gbps(4 << 30)["d2d_gbps"]
    len_min, len_max = 100, 1100
    max_len = len_max + args.steps + 8
    cfg = ModelConfig(vocab_size=129_280, max_seq_len=max_len, **BACKBONES[args.backbone])
    model = DecoderLM(cfg, device="cuda").bfloat16().eval()
    cache = ServingCache(model, n_slots=args.batch, max_len=max_len)
    lengths = torch.randint(len_min, len_max + 1, (args.batch,))
    slots = list(range(args.batch))
    ids = torch.randint(0, cfg.vocab_size, (args.batch,), device="cuda")
    index = torch.arange(args.batch, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    n_kv, head_dim = model.blocks[0].attn.n_kv_heads, model.blocks[0].attn.head_dim
    for layer in range(cfg.n_layers):
        k, v = (torch.randn(args.batch, n_kv, max_len, head_dim, device="cuda", generator=gen,
                            dtype=torch.bfloat16) for _ in range(2))
        cache.store_prefix(layer, index, k, v)
        del k, v

    def reset():
        cache.lengths.copy_(lengths.to(cache.lengths.device))
        cache.host_lengths = lengths.tolist()

    graphs, logits = {}, {}
    default = graphs_module.DECODE_BLAS
    for lib in ("cublas", "cublaslt"):
        graphs_module.DECODE_BLAS = lib
        try:
            reset()
            graphs[lib] = GraphedDecoder(model, cache)
        finally:
            graphs_module.DECODE_BLAS = default
        reset()
        logits[lib] = graphs[lib].step(slots, ids).float().clone()
    diff = float((logits["cublaslt"] - logits["cublas"]).abs().max())
    times = {name: [] for name in graphs}
    for _ in range(args.rounds):
        for name, graph in graphs.items():
            reset()
            ts = event_times_ms(lambda g=graph: g.step(slots, ids), args.steps)
            times[name].append(statistics.median(ts[3:]))
    mid = [int(n) + args.steps // 2 for n in lengths]
    bound_ms = (step_weight_bytes(model) + cache.live_kv_bytes(mid)) / (bw * 1e9) * 1e3
    step = {name: statistics.median(t) for name, t in times.items()}
    faster = sum(a < b for a, b in zip(times["cublaslt"], times["cublas"]))
    result = {"bench": "decode_blas_ab", "backbone": args.backbone, "batch": args.batch, "step_ms": step,
              "rounds": times, "rounds_lt_faster": faster, "bound_ms": bound_ms, "max_abs_logit_diff": diff,
              "logit_scale": float(logits["cublas"].abs().max()), "d2d_gbps": bw, "machine": machine_info()}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"decode_blas_ab_{args.backbone}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.backbone}: {'variant':9s} {'step ms':>8s} {'vs bound':>8s}  rounds")
    for name, ms in step.items():
        print(f"{args.backbone}: {name:9s} {ms:8.4f} {bound_ms / ms:8.3f}  " + " ".join(f"{t:.4f}" for t in times[name]))
    print(f"{args.backbone}: cuBLASLt faster in {faster}/{args.rounds} rounds; max |logit diff| {diff:.3g}")


if __name__ == "__main__":
    main()
