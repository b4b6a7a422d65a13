"""FlexAttention's tilings at the study's training shape (64 x 512 positions, 8 query and 4 K/V heads of
64, causal, bf16): forward + backward ms of the compiled op for each `kernel_options` set, whether two
backwards agree bit for bit, and the largest output / gradient difference from the default tiling.
Sets that do not compile are reported as such. The step's attention is `models.attention._flex_causal`.

    PYTHONPATH=src python3 benchmarks/probes/flex_tiles.py      # writes $OUT/flex_tiles.json
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from condmem.bench.harness import event_times_ms
from condmem.models.attention import _causal
from condmem.train.determinism import deterministic_mode, set_cublas_workspace
from condmem.utils.atomic import atomic_write_text

B, S, H, KV, D = 64, 512, 8, 4, 64
OPTIONS = {
    "default": None,
    "fwd128x64_w8_s3": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
    "fwd128x128_w8_s2": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
    "bwd64x64_w4_s3": {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64, "num_warps": 4, "num_stages": 3},
    "bwd32x64_w4_s3": {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32, "num_warps": 4, "num_stages": 3},
    "bwd64x128_w8_s2": {
        "BLOCK_M1": 64,
        "BLOCK_N1": 128,
        "BLOCK_M2": 128,
        "BLOCK_N2": 64,
        "num_warps": 8,
        "num_stages": 2,
    },
    "bwd32x128_w4_s3": {
        "BLOCK_M1": 32,
        "BLOCK_N1": 128,
        "BLOCK_M2": 128,
        "BLOCK_N2": 32,
        "num_warps": 4,
        "num_stages": 3,
    },
}


def run(options, q, k, v, dy, blocks):
    fn = torch.compile(
        lambda q, k, v: flex_attention(q, k, v, block_mask=blocks, enable_gqa=True, kernel_options=options)
    )

    def step():
        out = fn(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), dy)
        return out, grads

    first = step()
    again = step()
    repeatable = all(torch.equal(a, b) for a, b in zip(first[1], again[1]))
    return statistics.median(event_times_ms(step, 23)[3:]), repeatable, first  # the first 3 warm up


def main() -> None:
    set_cublas_workspace(True)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    k = torch.randn(B, KV, S, D, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    v = torch.randn(B, KV, S, D, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    dy = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    blocks = create_block_mask(_causal, None, None, S, S, device="cuda")
    result, base = {"device": torch.cuda.get_device_name(), "shape": [B, S, H, KV, D]}, None
    with deterministic_mode(True):
        for name, options in OPTIONS.items():
            torch._dynamo.reset()
            try:
                ms, repeatable, (out, grads) = run(options, q, k, v, dy, blocks)
            except Exception as exc:  # a tiling the kernel template refuses
                result[name] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
                print(f"{name:20s} failed: {result[name]['error'][:100]}")
                continue
            base = base or (out, grads)
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip((out, *grads), (base[0], *base[1])))
            result[name] = {"ms": ms, "repeatable": repeatable, "max_diff_vs_default": diff}
            print(f"{name:20s} {ms:7.3f} ms fwd+bwd  repeatable {repeatable}  max diff vs default {diff:.2e}")
    out_dir = Path(os.environ.get("OUT", "."))
    atomic_write_text(out_dir / "flex_tiles.json", json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
