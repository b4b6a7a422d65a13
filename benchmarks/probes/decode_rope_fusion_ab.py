"""A/B: decode attention with its RoPE + cache store fused (one launch a layer) against the
two launches (`rope_store`, then `paged_decode_attention`), in a graph-captured 4B step.

Both variants are `GraphedDecoder`s over the same cache (random keys and values,
`_decode_ab`; the recorded run, at 8ebd75a, read zero-filled caches); four alternating
rounds of ``--steps`` steps each (CUDA events, median). The logits of one step are compared (bf16;
the fused kernel's RoPE may round differently by an FMA). Prediction before the run: the
fused step 0.10-0.13 ms faster (the RoPE + store kernel took 3.6 us a layer in the profile).

    PYTHONPATH=src python3 benchmarks/probes/decode_rope_fusion_ab.py --out $OUT
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch
from _decode_ab import ab_arguments, decode_bench

import condmem.models.serving as serving
from condmem.bench.harness import machine_info
from condmem.models.graphs import GraphedDecoder
from condmem.ops.attention import paged_decode_attention, rope_store


_STEP = {}


def two_launches(q, k, v, cos, sin, k_pool, v_pool, table, n_keys):
    # Positions, rows and the valid mask once a step (as the serving code computed them), not per layer.
    key = n_keys.data_ptr()
    if key not in _STEP:
        _STEP.clear()
        _STEP[key] = ((n_keys - 1).clamp(min=0), torch.arange(q.shape[0], device=q.device), n_keys > 0)
    pos, rows, valid = _STEP[key]
    q = rope_store(q, k, v, cos, sin, pos, rows, table, k_pool, v_pool, valid)
    return paged_decode_attention(q, k_pool, v_pool, table, n_keys)


def main() -> None:
    args = ab_arguments(__doc__.splitlines()[0], rounds=4)
    bench = decode_bench(args.backbone, args.batch, args.steps)
    fused = serving.decode_attention_rope_store
    graphs, logits = {}, {}
    for name, fn in (("fused", fused), ("two_launches", two_launches)):
        serving.decode_attention_rope_store = fn
        try:
            bench.reset()
            graphs[name] = GraphedDecoder(bench.model, bench.cache)
        finally:
            serving.decode_attention_rope_store = fused
        bench.reset()
        logits[name] = bench.step(graphs[name]).float().clone()
    diff = float((logits["fused"] - logits["two_launches"]).abs().max())
    scale = float(logits["two_launches"].abs().max())
    times = bench.alternate(graphs, args.steps, args.rounds)
    bound_ms = bench.bound_ms(args.steps)
    step = {name: statistics.median(t) for name, t in times.items()}
    result = {"bench": "decode_rope_fusion_ab", "backbone": args.backbone, "batch": args.batch, "step_ms": step,
              "rounds": times, "bound_ms": bound_ms, "max_abs_logit_diff": diff, "logit_scale": scale,
              "machine": machine_info()}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "decode_rope_fusion_ab.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'variant':14s} {'step ms':>8s} {'vs bound':>8s}  rounds")
    for name, ms in step.items():
        print(f"{name:14s} {ms:8.4f} {bound_ms / ms:8.3f}  " + " ".join(f"{t:.4f}" for t in times[name]))
    print(f"max |logit diff| fused vs two launches {diff:.4g} (logit scale {scale:.3g})")


if __name__ == "__main__":
    main()
