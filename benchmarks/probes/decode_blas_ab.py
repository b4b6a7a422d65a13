"""A/B: the decode step's GEMMs captured from cuBLAS or cuBLASLt (`GraphedDecoder`'s
``DECODE_BLAS``), in a graph-captured step.

Both variants are `GraphedDecoder`s over the same cache (random keys and values,
`_decode_ab`), captured with ``condmem.models.graphs.DECODE_BLAS`` naming the library;
alternating rounds of ``--steps`` steps each (CUDA events, median). The logits of one step are compared (the
libraries may sum in another order: bf16 rounding). Prediction before the first run:
cuBLASLt 0.5-1% faster (one 4-round run at b8b9223: 5.485 vs 5.523 ms, rounds mixed).

    PYTHONPATH=src python3 benchmarks/probes/decode_blas_ab.py --backbone 4b --out $OUT
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from _decode_ab import ab_arguments, decode_bench

import condmem.models.graphs as graphs_module
from condmem.bench.harness import machine_info
from condmem.models.graphs import GraphedDecoder


def main() -> None:
    args = ab_arguments(__doc__.splitlines()[0], rounds=8)
    bench = decode_bench(args.backbone, args.batch, args.steps)
    graphs, logits = {}, {}
    default = graphs_module.DECODE_BLAS
    for lib in ("cublas", "cublaslt"):
        graphs_module.DECODE_BLAS = lib
        try:
            bench.reset()
            graphs[lib] = GraphedDecoder(bench.model, bench.cache)
        finally:
            graphs_module.DECODE_BLAS = default
        bench.reset()
        logits[lib] = bench.step(graphs[lib]).float().clone()
    diff = float((logits["cublaslt"] - logits["cublas"]).abs().max())
    times = bench.alternate(graphs, args.steps, args.rounds)
    bound_ms = bench.bound_ms(args.steps)
    step = {name: statistics.median(t) for name, t in times.items()}
    faster = sum(a < b for a, b in zip(times["cublaslt"], times["cublas"]))
    result = {"bench": "decode_blas_ab", "backbone": args.backbone, "batch": args.batch, "step_ms": step,
              "rounds": times, "rounds_lt_faster": faster, "bound_ms": bound_ms, "max_abs_logit_diff": diff,
              "logit_scale": float(logits["cublas"].abs().max()), "d2d_gbps": bench.d2d_gbps,
              "machine": machine_info()}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"decode_blas_ab_{args.backbone}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.backbone}: {'variant':9s} {'step ms':>8s} {'vs bound':>8s}  rounds")
    for name, ms in step.items():
        print(f"{args.backbone}: {name:9s} {ms:8.4f} {bound_ms / ms:8.3f}  " + " ".join(f"{t:.4f}" for t in times[name]))
    print(f"{args.backbone}: cuBLASLt faster in {faster}/{args.rounds} rounds; max |logit diff| {diff:.3g}")


if __name__ == "__main__":
    main()
