"""Attention backends at the study's training shape (64 x 512 positions, 8 query and 4 K/V heads of 64):
one forward and backward's ms (with the gradients' copies), whether two backwards agree bit for bit,
and the largest gradient difference from the first backend. SDPA's flash (GQA read in place, or K/V
repeated), cuDNN and memory-efficient backends, and FlexAttention compiled; `det` runs in
deterministic mode, where a backend without a deterministic backward is refused.

    PYTHONPATH=src python3 benchmarks/probes/attention_backends.py det|nondet   # writes $OUT/attn_<mode>.json
"""

import os
import sys
import time
import json
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

det = sys.argv[1] == "det"
if det:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
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

    bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device="cuda")
    fa = torch.compile(flex_attention)
    return lambda q, k, v: fa(q, k, v, block_mask=bm, enable_gqa=True)


def run(f):
    for t in (q, k, v):
        t.grad = None
    y = f(q, k, v)
    y.backward(dy)
    return [t.grad.clone() for t in (q, k, v)]


out = {}
cands = {
    "flash_gqa": lambda: sdpa(SDPBackend.FLASH_ATTENTION, True),
    "flash_rep": lambda: sdpa(SDPBackend.FLASH_ATTENTION, False),
    "cudnn_gqa": lambda: sdpa(SDPBackend.CUDNN_ATTENTION, True),
    "cudnn_rep": lambda: sdpa(SDPBackend.CUDNN_ATTENTION, False),
    "efficient_gqa": lambda: sdpa(SDPBackend.EFFICIENT_ATTENTION, True),
    "flex": flex,
}
ref = None
for name, mk in cands.items():
    try:
        f = mk()
        a = run(f)
        b = run(f)
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
        ms = (time.perf_counter() - t0) / 20 * 1e3
        out[name] = dict(ms=ms, repeatable=same, max_diff_vs_first=err)
    except Exception as e:
        out[name] = dict(error=str(e)[:200])
    print(f"{'det' if det else 'nondet'} {name:14s} {out[name]}", flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), f"attn_{sys.argv[1]}.json"), "w"), indent=1)
