"""The MoE router's fp32 GEMMs at the study's layer (32,768 tokens, dim 512, 62 experts): forward, input
gradient and weight gradient as the model runs them (`MoE.logits`: fp32 `F.linear`), against the same
with the expert rows padded to 64 (zero rows, sliced off), which may select better cuBLAS kernels.
Reports ms (CUDA events, median of 30) and whether the padded form gives the same bits.

    PYTHONPATH=src python3 benchmarks/probes/router_gemm.py     # writes $OUT/router_gemm.json
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from condmem.bench.harness import event_times_ms
from condmem.utils.atomic import atomic_write_text

TOKENS, DIM, EXPERTS = 32768, 512, 62


def timed(fn) -> float:
    return statistics.median(event_times_ms(fn, 35)[5:])  # the first 5 warm up


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # the router is fp32 by design
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(TOKENS, DIM, device="cuda", generator=g)
    w = torch.randn(EXPERTS, DIM, device="cuda", generator=g) / DIM**0.5
    dlogits = torch.randn(TOKENS, EXPERTS, device="cuda", generator=g)
    pad = torch.cat([w, w.new_zeros(64 - EXPERTS, DIM)])
    dpad = torch.cat([dlogits, dlogits.new_zeros(TOKENS, 64 - EXPERTS)], 1)
    forms = {
        "as_run": (lambda: F.linear(x, w), lambda: dlogits @ w, lambda: dlogits.t() @ x),
        "padded_64": (lambda: F.linear(x, pad)[:, :EXPERTS], lambda: dpad @ pad, lambda: (dpad.t() @ x)[:EXPERTS]),
    }
    result = {"device": torch.cuda.get_device_name(), "shape": [TOKENS, DIM, EXPERTS]}
    base = [f() for f in forms["as_run"]]
    for name, fns in forms.items():
        outs = [f() for f in fns]
        same = [torch.equal(a, b) for a, b in zip(outs, base)]
        ms = [timed(f) for f in fns]
        result[name] = {"forward_ms": ms[0], "dx_ms": ms[1], "dw_ms": ms[2], "same_bits": same}
        print(f"{name:10s} forward {ms[0]:.3f}  dx {ms[1]:.3f}  dw {ms[2]:.3f} ms   same bits {same}")
    atomic_write_text(Path(os.environ.get("OUT", ".")) / "router_gemm.json", json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
