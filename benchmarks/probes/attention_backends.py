"""Attention backends at the study's training shape (64 x 512 positions, 8 query and 4 K/V heads of 64):
one forward and backward's ms (with the gradients' copies), whether two backwards agree bit for bit,
and the largest gradient difference from the first backend. SDPA's flash (GQA read in place, or K/V
repeated), cuDNN and memory-efficient backends, and FlexAttention compiled; `det` runs in
deterministic mode, where a backend without a deterministic backward is refused.

    PYTHONPATH=src python3 benchmarks/probes/attention_backends.py det|nondet   # writes $OUT/attn_<mode>.json
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from condmem.models.attention import _causal
from condmem.train.determinism import deterministic_mode, set_cublas_workspace
from condmem.utils.atomic import atomic_write_text

det = sys.argv[1] == "det"
set_cublas_workspace(det)  # before cuBLAS starts
B, S, H, KV, D = 64, 512, 8, 4, 64
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
k = torch.randn(B, KV, S, D, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
v = torch.randn(B, KV, S, D, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
dy = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)


def sdpa(backend, gqa):
    def f(q, k, v):
        with sdpa_kernel(backend):
            if gqa:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return F.scaled_dot_product_attention(
                q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True
            )

    return f


def flex():
    from torch.nn.attention.flex_attention import flex_attention, create_block_mask

    bm = create_block_mask(_causal, None, None, S, S, device="cuda")  # the model's mask
    fa = torch.compile(flex_attention)
    return lambda q, k, v: fa(q, k, v, block_mask=bm, enable_gqa=True)


def run(f):
    for t in (q, k, v):
        t.grad = None
    y = f(q, k, v)
    y.backward(dy)
    return [t.grad.clone() for t in (q, k, v)]


cands = {
    "flash_gqa": lambda: sdpa(SDPBackend.FLASH_ATTENTION, True),
    "flash_rep": lambda: sdpa(SDPBackend.FLASH_ATTENTION, False),
    "cudnn_gqa": lambda: sdpa(SDPBackend.CUDNN_ATTENTION, True),
    "cudnn_rep": lambda: sdpa(SDPBackend.CUDNN_ATTENTION, False),
    "efficient_gqa": lambda: sdpa(SDPBackend.EFFICIENT_ATTENTION, True),
    "flex": flex,
}


def measure(make) -> dict:
    """Two backwards (the same bits?), the largest gradient difference from the first backend's, ms a step."""
    global ref
    f = make()
    a, b = run(f), run(f)
    same = all(torch.equal(x, y) for x, y in zip(a, b))
    if ref is None:
        ref = a
    err = max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, ref))
    for _ in range(3):
        run(f)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        run(f)
    torch.cuda.synchronize()
    return dict(ms=(time.perf_counter() - t0) / 20 * 1e3, repeatable=same, max_diff_vs_first=err)


out, ref = {}, None
with deterministic_mode(det):
    for name, make in cands.items():
        try:
            out[name] = measure(make)
        except Exception as e:  # a backend refused (e.g. no deterministic backward) is reported, the rest go on
            out[name] = dict(error=str(e)[:200])
        print(f"{'det' if det else 'nondet'} {name:14s} {out[name]}", flush=True)
atomic_write_text(Path(os.environ.get("OUT", ".")) / f"attn_{sys.argv[1]}.json", json.dumps(out, indent=1))
