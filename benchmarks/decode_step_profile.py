"""One graph-captured decode step of a dense backbone (no Engram) against its bytes bound, and where its time goes.

Builds the `condmem bench e2e` backbone (random bf16 weights), fills a `ServingCache` of
``--batch`` slots to lengths uniform in ``--len-min..--len-max`` (the keys' values do not
matter for time), times `GraphedDecoder.step` (CUDA events, median of ``--steps``) and
compares it with the bytes the step must read (weights but the embedding table, plus each
slot's live keys and values) at the device copy bandwidth measured in the same run. Then
one eager step under torch.profiler: the kernels by device time. Prints one JSON line.

    PYTHONPATH=src python benchmarks/decode_step_profile.py --backbone 4b
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from condmem.bench.e2e import BACKBONES, step_weight_bytes
from condmem.bench.harness import copy_bandwidth_gbps, event_times_ms
from condmem.models.config import ModelConfig
from condmem.serving.graphs import GraphedDecoder
from condmem.serving import ServingCache, decode_step
from condmem.models.transformer import DecoderLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backbone", default="4b", choices=sorted(BACKBONES))
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--len-min", type=int, default=100)
    p.add_argument("--len-max", type=int, default=1100)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--vocab", type=int, default=129_280)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth_gbps(4 << 30)["d2d_gbps"]
    max_len = args.len_max + args.steps + 8
    cfg = ModelConfig(vocab_size=args.vocab, max_seq_len=max_len, **BACKBONES[args.backbone])
    model = DecoderLM(cfg, device="cuda").bfloat16().eval()
    cache = ServingCache(model, n_slots=args.batch, max_len=max_len)
    lengths = torch.randint(args.len_min, args.len_max + 1, (args.batch,))
    cache.lengths.copy_(lengths)
    cache.host_lengths = lengths.tolist()
    graph = GraphedDecoder(model, cache)
    slots = list(range(args.batch))
    ids = torch.randint(0, args.vocab, (args.batch,), device="cuda")
    times = event_times_ms(lambda: graph.step(slots, ids), args.steps)
    step_ms = statistics.median(times[3:])
    mid = [int(n) + args.steps // 2 for n in lengths]
    bytes_step = step_weight_bytes(model) + cache.live_kv_bytes(mid)
    bound_ms = bytes_step / (bw * 1e9) * 1e3
    from torch.profiler import ProfilerActivity, profile

    eager_slots = torch.arange(args.batch, device="cuda")
    decode_step(model, cache, eager_slots, ids, check=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decode_step(model, cache, eager_slots, ids, check=False)
        torch.cuda.synchronize()
    key = "self_device_time_total"
    events = sorted((e for e in prof.key_averages() if getattr(e, key, 0) > 0), key=lambda e: -getattr(e, key))
    total = sum(getattr(e, key) for e in events)
    print(f"{'kernel':90s} {'calls':>6s} {'us':>9s} {'share':>6s}")
    for e in events[: args.top]:
        t = getattr(e, key)
        print(f"{e.key[:90]:90s} {e.count:6d} {t:9.1f} {t / max(total, 1):6.1%}")
    launches = sum(e.count for e in events)
    print(
        json.dumps(
            {
                "backbone": args.backbone,
                "batch": args.batch,
                "mean_len": float(lengths.float().mean()),
                "graph_step_ms": step_ms,
                "bound_ms": bound_ms,
                "vs_bound": bound_ms / step_ms,
                "bytes_per_step": bytes_step,
                "d2d_gbps": bw,
                "eager_kernel_us": total,
                "eager_kernel_launches": launches,
            }
        )
    )


if __name__ == "__main__":
    main()
