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

import torch
from _decode_ab import ab_arguments, decode_bench, report

import condmem.serving.steps as serving
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
    graphs, logits = bench.capture_variants(
        serving,
        "decode_attention_rope_store",
        {"fused": serving.decode_attention_rope_store, "two_launches": two_launches},
    )
    diff = float((logits["fused"] - logits["two_launches"]).abs().max())
    scale = float(logits["two_launches"].abs().max())
    times = bench.alternate(graphs, args.steps, args.rounds)
    report(
        args.out,
        "decode_rope_fusion_ab.json",
        {
            "bench": "decode_rope_fusion_ab",
            "backbone": args.backbone,
            "batch": args.batch,
            "max_abs_logit_diff": diff,
            "logit_scale": scale,
        },
        times,
        bench.bound_ms(args.steps),
    )
    print(f"max |logit diff| fused vs two launches {diff:.4g} (logit scale {scale:.3g})")


if __name__ == "__main__":
    main()
