"""Tensor-parallel Engram at world size 1 on one GPU (NCCL): exact against the unsharded
memory, and what the sharded path costs when there is nothing to exchange.

    torchrun --nproc-per-node 1 benchmarks/tp_world1.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from condmem import EngramConfig, EngramLayout, NgramHasher
from condmem.serving import EngramMemory


def timed(memory, batches, layer_ids) -> list[float]:
    out = []
    for ids in batches:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prepared = memory.prepare(ids)
        for lid in layer_ids:
            prepared.row_vectors(lid)
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--tier", default="hbm")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    cfg = EngramConfig(
        layer_ids=[1, 14], max_ngram_size=4, n_heads=8, head_dim=256, table_size=200_003, compressed_vocab_size=99_092
    )
    layout = EngramLayout(cfg)
    hasher = NgramHasher(layout)
    weights = {lid: torch.randn(layout.layer(lid).num_embeddings, 256).bfloat16() for lid in cfg.layer_ids}
    plain = EngramMemory.from_weights(hasher, weights, args.tier, "cuda", progress=False)
    sharded = EngramMemory.from_weights(
        hasher, weights, args.tier, "cuda", progress=False, process_group=dist.group.WORLD
    )
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 99_092, (1, args.tokens), generator=gen) for _ in range(24)]
    for ids in batches[:2]:
        a, b = plain.prepare(ids), sharded.prepare(ids)
        for lid in cfg.layer_ids:
            assert torch.equal(a.row_vectors(lid), b.row_vectors(lid)), "sharded rows differ at world size 1"
    rounds = []
    for _ in range(3):  # interleaved, so drift hits both
        rounds.append(
            (
                statistics.median(timed(plain, batches[2:], cfg.layer_ids)),
                statistics.median(timed(sharded, batches[2:], cfg.layer_ids)),
            )
        )
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "tier": args.tier,
        "tokens": args.tokens,
        "layers": cfg.layer_ids,
        "rows_per_layer": layout.num_embeddings,
        "exact": True,
        "ms_plain_vs_sharded_per_round": rounds,
        "ratio": statistics.median(s / p for p, s in rounds),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "tp_world1.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    plain.close()
    sharded.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
