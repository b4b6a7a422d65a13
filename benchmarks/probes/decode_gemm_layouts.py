"""Does the weight's memory layout change how fast cuBLAS runs a decode step's GEMMs?

At decode a block's projections are skinny GEMMs, [M = sequences, K] x [K, N], bound by reading
the weight. cuBLAS picks its kernel by shape and by operand layout, so the same product with the
weight stored [N, K] (``F.linear``'s layout, transposed in the GEMM) or [K, N] (no transpose) may
run a different kernel, and cuBLASLt (``torch.backends.cuda.preferred_blas_library``) picks
from another set. For each projection of the 4B and 8B backbones: time of both layouts (and
of the down and output projections with the residual accumulated in place, ``addmm_``), each
with cuBLAS and with cuBLASLt, as CUDA graphs cycling over 4 copies of the weight (no L2
reuse), against the weight's bytes at the device copy bandwidth measured in the same run.
Outputs of the two layouts are compared first.

    PYTHONPATH=src python3 benchmarks/probes/decode_gemm_layouts.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from condmem.bench.e2e import BACKBONES
from condmem.bench.harness import copy_bandwidth_gbps, graph_replay_ms


def shapes(name: str) -> dict[str, tuple[int, int]]:
    s = BACKBONES[name]
    hd = s["dim"] // s["n_heads"]
    return {
        "qkv": ((s["n_heads"] + 2 * s["n_kv_heads"]) * hd, s["dim"]),
        "wo": (s["dim"], s["n_heads"] * hd),
        "gate_up": (2 * s["ffn_hidden"], s["dim"]),
        "down": (s["dim"], s["ffn_hidden"]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".")
    p.add_argument("--m", type=int, nargs="+", default=[128])
    args = p.parse_args()
    bw = copy_bandwidth_gbps(4 << 30)["d2d_gbps"]
    rows = []
    for backbone in ("4b", "8b"):
        for proj, (n, k) in shapes(backbone).items():
            for m in args.m:
                w_nk = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(4)]
                w_kn = [w.t().contiguous() for w in w_nk]
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
                a, b = F.linear(x, w_nk[0]).float(), (x @ w_kn[0]).float()
                err = float((a - b).norm() / a.norm())
                variants = {"[N,K] F.linear": lambda w: F.linear(x, w), "[K,N] x @ w": lambda w: x @ w}
                sets = {"[N,K] F.linear": w_nk, "[K,N] x @ w": w_kn}
                if proj in ("down", "wo"):
                    variants["[N,K] res.addmm_"] = lambda w: res.addmm_(x, w.t())
                    variants["[K,N] res.addmm_"] = lambda w: res.addmm_(x, w)
                    sets["[N,K] res.addmm_"], sets["[K,N] res.addmm_"] = w_nk, w_kn
                before = torch.backends.cuda.preferred_blas_library()
                for lib in ("cublas", "cublaslt"):
                    torch.backends.cuda.preferred_blas_library(lib)
                    try:
                        for name, fn in variants.items():
                            ms = graph_replay_ms(fn, [(w,) for w in sets[name]])
                            rows.append(
                                {
                                    "backbone": backbone,
                                    "proj": proj,
                                    "m": m,
                                    "n": n,
                                    "k": k,
                                    "variant": f"{lib} {name}",
                                    "ms": ms,
                                    "x_copy_bound": n * k * 2 / (bw * 1e9) * 1e3 / ms,
                                    "rel_err": err,
                                    "d2d_gbps": bw,
                                }
                            )
                    finally:
                        torch.backends.cuda.preferred_blas_library(before)
                del w_nk, w_kn
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_gemm_layouts.json").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    print(f"copy bandwidth {bw:.0f} GB/s")
    for r in rows:
        print(
            f"{r['backbone']:3s} {r['proj']:8s} m{r['m']:<4d} [{r['n']}x{r['k']}] {r['variant']:28s} "
            f"{r['ms'] * 1e3:8.1f} us  x bound {r['x_copy_bound']:.2f}"
        )


if __name__ == "__main__":
    main()
