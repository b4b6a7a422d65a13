"""A/B: the decode attention kernel reading a head as two power-of-two column pieces (80 = 64 +
16: no padding columns loaded or staged) against one piece padded to a power of two (80 -> 128),
at kernel level (launch configurations swept) and in the graph-captured 4B decode step.

Kernel rows: the 4B (head_dim 80) and 8B (128) attention of one layer at the decode step of
`bench e2e` (128 sequences, 100..1100 cached positions, heads-outer pool of 2048 positions a
sequence, block table scattered), checked against the reference, timed as a CUDA graph of 8
launches over 4 input sets, against the device copy bandwidth of the same run. Step rows: the
4B `GraphedDecoder` with each attention variant, alternating rounds, logits compared.
Prediction before the run: the split 5-15% faster at head_dim 80 (its staged tiles 20 KB a
stage instead of 32 KB, so more loads in flight a multiprocessor), the 4B step 0.1-0.3 ms
faster; head_dim 128 unchanged (the same kernel).

    PYTHONPATH=src python3 benchmarks/probes/decode_head_dim_split_ab.py --out $OUT
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from pathlib import Path

import torch

from condmem.bench.e2e import BACKBONES, step_weight_bytes
from condmem.bench.harness import copy_bandwidth_gbps, event_times_ms, graph_replay_ms, machine_info
from condmem.models.config import ModelConfig
from condmem.models.graphs import GraphedDecoder
from condmem.models.serving import ServingCache
from condmem.models.transformer import DecoderLM
from condmem.ops.attention import reference as attn_ref
from condmem.ops.attention import triton as attn_triton

CONFIGS = [  # (split the head dim, block_n, warps, stages)
    (False, 64, 4, 2), (True, 64, 4, 2), (True, 64, 4, 3), (True, 64, 4, 4), (True, 32, 4, 3),
    (True, 128, 4, 2), (True, 128, 8, 2), (True, 128, 8, 3), (False, 64, 4, 3),
]


def name_of(cfg) -> str:
    split, bn, w, st = cfg
    return f"{'split' if split else 'padded'} bn{bn} w{w} s{st}"


def kernel_rows(bw: float, backbone: str, batch: int = 128, block_size: int = 16, max_len: int = 2048) -> list[dict]:
    shape = BACKBONES[backbone]
    heads, n_kv = shape["n_heads"], shape["n_kv_heads"]
    head_dim = shape["dim"] // heads
    gen = torch.Generator(device="cuda").manual_seed(1)
    per_seq = max_len // block_size
    lengths = torch.randint(100, 1101, (batch,), device="cuda", generator=gen).to(torch.int32)
    n_blocks = batch * per_seq
    sets = []
    for _ in range(4):
        k, v = (torch.randn((n_blocks, n_kv, block_size, head_dim), device="cuda", dtype=torch.bfloat16,
                            generator=gen).transpose(1, 2) for _ in range(2))
        table = torch.randperm(n_blocks, device="cuda", generator=gen).view(batch, per_seq).to(torch.int32)
        q = torch.randn((batch, heads, head_dim), device="cuda", dtype=torch.bfloat16, generator=gen)
        sets.append((q, k, v, table))
    want = attn_ref.paged_decode_attention_ref(*sets[0], lengths, None).float()
    nbytes = int(lengths.sum()) * n_kv * head_dim * 2 * 2 + 2 * batch * heads * head_dim * 2
    rows = []
    for cfg in CONFIGS:
        split, bn, w, st = cfg
        if head_dim & (head_dim - 1) == 0 and split:
            continue                                    # a power of two: one piece either way
        fn = functools.partial(_attend, lengths=lengths, split=split, bn=bn, w=w, st=st)
        try:
            err = float((fn(*sets[0]).float() - want).norm() / want.norm())
            assert err < 2e-2, err
            ms = graph_replay_ms(fn, sets)
        except Exception as exc:  # noqa: BLE001 - a configuration the compiler refuses
            rows.append({"backbone": backbone, "variant": name_of(cfg), "error": str(exc)[:200]})
            continue
        rows.append({"backbone": backbone, "head_dim": head_dim, "variant": name_of(cfg), "ms": ms, "rel_err": err,
                     "x_bound": nbytes / (bw * 1e9) * 1e3 / ms})
    return rows


def _attend(q, k, v, t, *, lengths, split, bn, w, st):
    return attn_triton.paged_decode_attention(q, k, v, t, lengths, block_n=bn, num_warps=w, num_stages=st,
                                              split_head_dim=split)


def step_rows(bw: float, configs, steps: int = 30, rounds: int = 4, batch: int = 128) -> dict:
    torch.manual_seed(0)
    len_min, len_max = 100, 1100
    max_len = len_max + steps + 8
    cfg = ModelConfig(vocab_size=129_280, max_seq_len=max_len, **BACKBONES["4b"])
    model = DecoderLM(cfg, device="cuda").bfloat16().eval()
    cache = ServingCache(model, n_slots=batch, max_len=max_len)
    lengths = torch.randint(len_min, len_max + 1, (batch,))
    slots = list(range(batch))
    ids = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")

    def reset():
        cache.lengths.copy_(lengths.to(cache.lengths.device))
        cache.host_lengths = lengths.tolist()

    original = attn_triton.paged_decode_attention
    graphs, logits = {}, {}
    for c in configs:
        split, bn, w, st = c
        attn_triton.paged_decode_attention = functools.partial(original, block_n=bn, num_warps=w, num_stages=st,
                                                               split_head_dim=split)
        try:
            reset()
            graphs[name_of(c)] = GraphedDecoder(model, cache)
            reset()
            logits[name_of(c)] = graphs[name_of(c)].step(slots, ids).float().clone()
        finally:
            attn_triton.paged_decode_attention = original
    first = next(iter(logits.values()))
    diffs = {n: float((lg - first).abs().max()) for n, lg in logits.items()}
    times = {n: [] for n in graphs}
    for _ in range(rounds):
        for n, graph in graphs.items():
            reset()
            times[n].append(statistics.median(event_times_ms(lambda g=graph: g.step(slots, ids), steps)[3:]))
    mid = [int(n) + steps // 2 for n in lengths]
    bound_ms = (step_weight_bytes(model) + cache.live_kv_bytes(mid)) / (bw * 1e9) * 1e3
    for g in graphs.values():
        g.close()
    return {"step_ms": {n: statistics.median(t) for n, t in times.items()}, "rounds": times, "bound_ms": bound_ms,
            "max_abs_logit_diff_vs_first": diffs, "logit_scale": float(first.abs().max())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".")
    p.add_argument("--step-configs", nargs="*", type=int, default=[0, 1, 2],
                   help="indices into CONFIGS timed in the 4B decode step")
    args = p.parse_args()
    bw = copy_bandwidth_gbps(4 << 30)["d2d_gbps"]
    rows = kernel_rows(bw, "4b") + kernel_rows(bw, "8b")
    print(f"copy bandwidth {bw:.0f} GB/s")
    for r in rows:
        print(f"{r['backbone']:3s} {r['variant']:22s} " + (f"{r['ms']:.4f} ms  x bound {r['x_bound']:.3f}"
                                                            if "ms" in r else f"error {r['error']}"))
    step = step_rows(bw, [CONFIGS[i] for i in args.step_configs])
    result = {"bench": "decode_head_dim_split_ab", "d2d_gbps": bw, "kernel_rows": rows, "step_4b": step,
              "machine": machine_info()}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "decode_head_dim_split_ab.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"4b step (bound {step['bound_ms']:.3f} ms)")
    for n, ms in step["step_ms"].items():
        print(f"  {n:22s} {ms:.4f} ms  x bound {step['bound_ms'] / ms:.3f}  "
              + " ".join(f"{t:.4f}" for t in step["rounds"][n])
              + f"  max|dlogit| {step['max_abs_logit_diff_vs_first'][n]:.3g}")


if __name__ == "__main__":
    main()
