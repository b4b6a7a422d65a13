"""A/B: the decode step's GEMMs captured from cuBLAS or cuBLASLt (`GraphedDecoder`'s
``DECODE_BLAS``), in a graph-captured step.

Both variants are `GraphedDecoder`s over the same cache (random keys and values,
`_decode_ab`), captured with ``condmem.serving.graphs.DECODE_BLAS`` naming the library;
alternating rounds of ``--steps`` steps each (CUDA events, median). The logits of one step are compared (the
libraries may sum in another order: bf16 rounding). Prediction before the first run:
cuBLASLt 0.5-1% faster (one 4-round run at b8b9223: 5.485 vs 5.523 ms, rounds mixed).

    PYTHONPATH=src python3 benchmarks/probes/decode_blas_ab.py --backbone 4b --out $OUT
"""

from __future__ import annotations

from _decode_ab import ab_arguments, decode_bench, report

import condmem.serving.graphs as graphs_module


def main() -> None:
    args = ab_arguments(__doc__.splitlines()[0], rounds=8)
    bench = decode_bench(args.backbone, args.batch, args.steps)
    graphs, logits = bench.capture_variants(graphs_module, "DECODE_BLAS", {"cublas": "cublas", "cublaslt": "cublaslt"})
    diff = float((logits["cublaslt"] - logits["cublas"]).abs().max())
    times = bench.alternate(graphs, args.steps, args.rounds)
    faster = sum(a < b for a, b in zip(times["cublaslt"], times["cublas"]))
    report(
        args.out,
        f"decode_blas_ab_{args.backbone}.json",
        {
            "bench": "decode_blas_ab",
            "backbone": args.backbone,
            "batch": args.batch,
            "rounds_lt_faster": faster,
            "max_abs_logit_diff": diff,
            "logit_scale": float(logits["cublas"].abs().max()),
            "d2d_gbps": bench.d2d_gbps,
        },
        times,
        bench.bound_ms(args.steps),
        prefix=f"{args.backbone}: ",
    )
    print(f"{args.backbone}: cuBLASLt faster in {faster}/{args.rounds} rounds; max |logit diff| {diff:.3g}")


if __name__ == "__main__":
    main()
