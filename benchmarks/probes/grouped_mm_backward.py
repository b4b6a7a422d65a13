"""Where the MoE's grouped GEMMs spend their backward: torch's `_grouped_mm` forward, its autograd
backward, the input gradient alone, the weight gradient alone (torch's k-grouped GEMM) and the
Triton weight gradient (`condmem.ops.grouped_weight_grad`) in a few tilings, against a dense GEMM
of the same FLOPs as the ceiling.

The gpu study preset's layer: 32,768 tokens, top-2 of 62 experts, dim 512, expert width 256, routed
by random logits (some imbalance) and laid out as the model lays them out (`moe._layout`). CUDA
events, the median of 30 launches after 5; every input is larger than L2. The weight gradients are
compared with an fp32 reference (max error relative to the reference's largest entry).

    PYTHONPATH=src python benchmarks/probes/grouped_mm_backward.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from condmem.bench.harness import event_times_ms
from condmem.models.moe import _layout
from condmem.ops.grouped_weight_grad.reference import grouped_weight_grad_reference
from condmem.ops.grouped_weight_grad.triton import weight_grad_tiled

CONFIGS = [  # block_n, block_k, block_m, warps, stages
    (128, 128, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (128, 128, 32, 4, 4),
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
]


def timed(fn) -> float:
    return statistics.median(event_times_ms(fn, 35)[5:])  # the first 5 warm up


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


def one_weight(name: str, x: torch.Tensor, n_out: int, ends: torch.Tensor, rows: int) -> dict:
    experts, k_in = ends.numel(), x.shape[1]
    w = (torch.randn(experts, n_out, k_in, device="cuda") / k_in**0.5).bfloat16().requires_grad_()
    dy = torch.randn(rows, n_out, device="cuda", dtype=torch.bfloat16)
    flops = 2 * rows * n_out * k_in
    out = {"shape": [rows, n_out, k_in, experts], "gflop": flops / 1e9}
    out["forward"] = timed(lambda: torch._grouped_mm(x, w.detach().transpose(-2, -1), offs=ends))

    def autograd_backward():
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)
        y.backward(dy)
        w.grad = None

    out["forward+backward"] = timed(autograd_backward)
    out["dx"] = timed(lambda: torch._grouped_mm(dy, w.detach(), offs=ends))
    ref = grouped_weight_grad_reference(dy, x, ends)
    for key, (left, right) in {"dw_torch": (dy.t(), x), "dw_torch_contiguous_t": (dy.t().contiguous(), x)}.items():
        try:
            out[key + "_err"] = rel_err(torch._grouped_mm(left, right, offs=ends), ref)
            out[key] = timed(lambda: torch._grouped_mm(left, right, offs=ends))
        except Exception as exc:
            out[key] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
    a, b = (
        torch.randn(rows, k_in, device="cuda", dtype=torch.bfloat16),
        torch.randn(k_in, n_out, device="cuda", dtype=torch.bfloat16),
    )
    out["dense_same_flops"] = timed(lambda: a @ b)
    for cfg in CONFIGS:
        key = "dw_triton_" + "_".join(map(str, cfg))
        try:
            got = weight_grad_tiled(dy, x, ends, torch.float32, *cfg)
            out[key + "_err"] = rel_err(got, ref)
            out[key] = timed(lambda: weight_grad_tiled(dy, x, ends, torch.float32, *cfg))
        except Exception as exc:  # a tiling that does not fit shared memory
            out[key] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
    print(f"\n{name}: rows {rows}, out {n_out}, in {k_in}, {flops / 1e9:.1f} GFLOP per GEMM")
    for key, value in out.items():
        if isinstance(value, float) and not key.endswith("_err") and key != "gflop":
            per = flops * (3 if key == "forward+backward" else 1)
            err = out.get(key + "_err")
            tail = f"  err {err:.1e}" if err is not None else ""
            print(f"  {key:28s} {value * 1e3:8.1f} us  {per / value / 1e9:6.0f} TFLOP/s{tail}")
        elif isinstance(value, str):
            print(f"  {key:28s} {value}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    tokens, dim, experts, hidden, top_k = 32768, 512, 62, 256, 2
    logits = torch.randn(tokens, experts, device="cuda") + torch.randn(experts, device="cuda") * 0.3
    chosen = logits.topk(top_k, dim=-1).indices
    _, _, ends, rows = _layout(chosen, experts, None)
    x = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    result = {
        "device": torch.cuda.get_device_name(),
        "group_rows": torch.diff(ends, prepend=ends.new_zeros(1)).tolist(),
        "w13": one_weight("w13 (dim -> 2 x hidden)", x, 2 * hidden, ends, rows),
        "w2": one_weight("w2 (hidden -> dim)", h, dim, ends, rows),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grouped_mm_backward.json").write_text(json.dumps(result, indent=1))
    print(result["device"])


if __name__ == "__main__":
    main()
