"""A/B of the decode attention's split combine inside a graph-captured 4B decode step.

Variants (one `GraphedDecoder` each over the same cache, alternating rounds, median step):

* ``default``: the serving kernels (one combine program per (sequence, head), one warp);
* ``wide_combine``: one combine program per (sequence, 8 heads), four warps;
* ``splits_1`` / ``splits_2``: a fixed number of splits (1: no combine at all).

Logits of every variant are compared with the default's (splits change the summation
order: bf16 tolerance). Prediction before the run: wide combine 3.6 -> ~2.5 us a layer,
step -0.04 ms; one split slower (1,024 programs for lengths up to 1,100).

    PYTHONPATH=src python3 benchmarks/probes/decode_combine_ab.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

import condmem.ops.attention.triton as attn
from condmem.bench.e2e import BACKBONES, step_weight_bytes
from condmem.bench.harness import copy_bandwidth_gbps, machine_info
from condmem.models.config import ModelConfig
from condmem.models.graphs import GraphedDecoder
from condmem.models.serving import ServingCache
from condmem.models.transformer import DecoderLM

HB = 8


@triton.jit
def _combine_wide_kernel(PO, PML, O, LENS, so_b, so_h, split_len, n_splits, n_heads, HB: tl.constexpr,
                         S_P: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    limit = tl.maximum(tl.cdiv(tl.load(LENS + b).to(tl.int32), split_len), 1)
    if limit > 1:
        h = tl.program_id(1) * HB + tl.arange(0, HB)
        s = tl.arange(0, S_P)
        d = tl.arange(0, DP)
        hm = h < n_heads
        sm = (s[None, :] < limit) & hm[:, None]
        base = (b * n_heads + h[:, None]) * n_splits + s[None, :]
        m = tl.load(PML + base * 2, mask=sm, other=float("-inf"))
        l = tl.load(PML + base * 2 + 1, mask=sm, other=0.0)
        top = tl.max(m, 1)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp2(m - top[:, None])
        denom = tl.sum(w * l, 1)
        acc = tl.load(PO + base[:, :, None] * D + d[None, None, :], mask=sm[:, :, None] & (d < D)[None, None, :],
                      other=0.0)
        out = tl.sum(acc * w[:, :, None], 1) / tl.maximum(denom, 1e-30)[:, None]
        tl.store(O + b * so_b + h[:, None] * so_h + d[None, :], out.to(O.dtype.element_ty),
                 mask=hm[:, None] & (d < D)[None, :])


class _WideLauncher:
    """Stands in for ``_decode_combine_kernel[grid]`` while a graph is captured."""

    def __getitem__(self, grid):
        batch, n_heads = grid

        def launch(part_o, part_ml, out, lengths, so_b, so_h, split_len, splits, n_heads_, S_P, D, DP, num_warps):
            _combine_wide_kernel[(batch, triton.cdiv(n_heads, HB))](
                part_o, part_ml, out, lengths, so_b, so_h, split_len, splits, n_heads_, HB=HB, S_P=S_P, D=D, DP=DP,
                num_warps=4)
        return launch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".")
    p.add_argument("--backbone", default="4b", choices=sorted(BACKBONES))
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth_gbps(4 << 30)["d2d_gbps"]
    len_min, len_max = 100, 1100
    max_len = len_max + args.steps * args.rounds * 4 + 8
    cfg = ModelConfig(vocab_size=129_280, max_seq_len=max_len, **BACKBONES[args.backbone])
    model = DecoderLM(cfg, device="cuda").bfloat16().eval()
    cache = ServingCache(model, n_slots=args.batch, max_len=max_len)
    lengths = torch.randint(len_min, len_max + 1, (args.batch,))
    slots = list(range(args.batch))
    ids = torch.randint(0, cfg.vocab_size, (args.batch,), device="cuda")

    def reset():
        cache.lengths.copy_(lengths.to(cache.lengths.device))
        cache.host_lengths = lengths.tolist()

    default_splits, default_combine = attn.decode_splits, attn._decode_combine_kernel
    variants = {"default": {}, "wide_combine": {"combine": _WideLauncher()}, "splits_1": {"splits": 1},
                "splits_2": {"splits": 2}}
    graphs, logits = {}, {}
    for name, v in variants.items():
        attn.decode_splits = (lambda *a, n=v["splits"], **k: n) if "splits" in v else default_splits
        attn._decode_combine_kernel = v.get("combine", default_combine)
        try:
            reset()
            graphs[name] = GraphedDecoder(model, cache)
        finally:
            attn.decode_splits, attn._decode_combine_kernel = default_splits, default_combine
        reset()
        logits[name] = graphs[name].step(slots, ids).float().clone()
    errors = {name: float((logits[name] - logits["default"]).abs().max()) for name in graphs}
    scale = float(logits["default"].abs().max())

    times = {name: [] for name in graphs}
    for _ in range(args.rounds):
        for name, graph in graphs.items():
            reset()
            ts = []
            for _ in range(args.steps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.step(slots, ids)
                end.record()
                end.synchronize()
                ts.append(start.elapsed_time(end))
            times[name].append(statistics.median(ts[3:]))
    mid = [int(n) + args.steps // 2 for n in lengths]
    bound_ms = (step_weight_bytes(model) + cache.live_kv_bytes(mid)) / (bw * 1e9) * 1e3
    step = {name: statistics.median(t) for name, t in times.items()}
    result = {"bench": "decode_combine_ab", "backbone": args.backbone, "batch": args.batch, "step_ms": step,
              "rounds": times, "bound_ms": bound_ms, "max_abs_logit_diff": errors, "logit_scale": scale,
              "machine": machine_info()}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "decode_combine_ab.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'variant':14s} {'step ms':>8s} {'vs bound':>8s} {'max |dlogit|':>12s}  rounds")
    for name, ms in step.items():
        print(f"{name:14s} {ms:8.4f} {bound_ms / ms:8.3f} {errors[name]:12.4g}  "
              + " ".join(f"{t:.4f}" for t in times[name]))
    print(f"logit scale {scale:.3g}")


if __name__ == "__main__":
    main()
