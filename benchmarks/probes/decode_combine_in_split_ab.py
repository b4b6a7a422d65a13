"""A/B: a graph-captured decode step whose attention combines its splits inside the split
kernel (the last split of each sequence and KV head to finish, through `ServingCache`'s
counters) against the same step with a second launch for the combine.

Both variants are `GraphedDecoder`s over the same cache and weights; alternating rounds of
``--steps`` steps each (CUDA events, median); logits compared (the combine's fp32 sums are
the same terms in another order). Prediction before the run: the 4B step 0.08-0.12 ms faster
(the combine launch took 3.6 us a layer in the profile, 36 layers), the 8B about the same.

    PYTHONPATH=src python3 benchmarks/probes/decode_combine_in_split_ab.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import condmem.models.serving as serving
from condmem.bench.e2e import BACKBONES, step_weight_bytes
from condmem.bench.harness import copy_bandwidth_gbps, event_times_ms, machine_info
from condmem.models.config import ModelConfig
from condmem.models.graphs import GraphedDecoder
from condmem.models.serving import ServingCache
from condmem.models.transformer import DecoderLM


def run_backbone(name: str, args, bw: float) -> dict:
    torch.manual_seed(0)
    len_min, len_max = 100, 1100
    max_len = len_max + args.steps + 8
    cfg = ModelConfig(vocab_size=129_280, max_seq_len=max_len, **BACKBONES[name])
    model = DecoderLM(cfg, device="cuda").bfloat16().eval()
    cache = ServingCache(model, n_slots=args.batch, max_len=max_len)
    lengths = torch.randint(len_min, len_max + 1, (args.batch,))
    slots = list(range(args.batch))
    ids = torch.randint(0, cfg.vocab_size, (args.batch,), device="cuda")

    def reset():
        cache.lengths.copy_(lengths.to(cache.lengths.device))
        cache.host_lengths = lengths.tolist()

    inside = serving.decode_attention_rope_store

    def two_launches(*args, counters=None, **kwargs):
        return inside(*args, **kwargs)

    graphs, logits = {}, {}
    for variant, fn in (("in_split", inside), ("launch", two_launches)):
        serving.decode_attention_rope_store = fn
        try:
            reset()
            graphs[variant] = GraphedDecoder(model, cache)
            reset()
            logits[variant] = graphs[variant].step(slots, ids).float().clone()
        finally:
            serving.decode_attention_rope_store = inside
    diff = float((logits["in_split"] - logits["launch"]).abs().max())
    times = {v: [] for v in graphs}
    for _ in range(args.rounds):
        for variant, graph in graphs.items():
            reset()
            ts = event_times_ms(lambda g=graph: g.step(slots, ids), args.steps)
            times[variant].append(statistics.median(ts[3:]))
    mid = [int(n) + args.steps // 2 for n in lengths]
    bound_ms = (step_weight_bytes(model) + cache.live_kv_bytes(mid)) / (bw * 1e9) * 1e3
    step = {v: statistics.median(t) for v, t in times.items()}
    for g in graphs.values():
        g.close()
    return {"backbone": name, "step_ms": step, "rounds": times, "bound_ms": bound_ms, "max_abs_logit_diff": diff,
            "logit_scale": float(logits["launch"].abs().max())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".")
    p.add_argument("--backbones", nargs="+", default=["4b", "8b"], choices=sorted(BACKBONES))
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    bw = copy_bandwidth_gbps(4 << 30)["d2d_gbps"]
    rows = []
    for name in args.backbones:
        rows.append(run_backbone(name, args, bw))
        torch.cuda.empty_cache()
    result = {"bench": "decode_combine_in_split_ab", "batch": args.batch, "d2d_gbps": bw, "rows": rows,
              "machine": machine_info()}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "decode_combine_in_split_ab.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'backbone':8s} {'variant':8s} {'step ms':>8s} {'vs bound':>8s}  rounds")
    for row in rows:
        for v, ms in row["step_ms"].items():
            print(f"{row['backbone']:8s} {v:8s} {ms:8.4f} {row['bound_ms'] / ms:8.3f}  "
                  + " ".join(f"{t:.4f}" for t in row["rounds"][v]))
        print(f"{row['backbone']:8s} max |logit diff| {row['max_abs_logit_diff']:.3g} "
              f"(logit scale {row['logit_scale']:.3g})")


if __name__ == "__main__":
    main()
