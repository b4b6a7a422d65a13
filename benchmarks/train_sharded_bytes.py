"""Bytes per table parameter of `ShardedTable` training, per rank, measured on the CPU with gloo.

Each rank holds its shard of one layer's table and `SparseAdam`'s state for the rows it
owns that were read. After ``--steps`` steps on random token batches every rank reports the
bytes of its tensors (shard + Adam state) and the growth of its resident memory (RSS), both
per parameter of the whole table; at world size 1 the shard is the whole table.

    PYTHONPATH=src python benchmarks/train_sharded_bytes.py --world 1 2 4 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from condmem import EngramConfig, EngramLayout, NgramHasher
from condmem.distributed import ShardedTable, ShardPlan
from condmem.train.optim import SparseAdam


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def layout_for(args) -> EngramLayout:
    return EngramLayout(
        EngramConfig(
            layer_ids=[1],
            max_ngram_size=3,
            n_heads=4,
            head_dim=args.head_dim,
            table_size=args.table_size,
            compressed_vocab_size=50_000,
        )
    )


def worker(rank: int, world: int, init: str, args, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    layout = layout_for(args)
    hasher = NgramHasher(layout)
    plan = ShardPlan.for_layer(layout.layer(1), world)
    r0, r1 = plan.row_range(rank)
    before = rss()
    gen = torch.Generator().manual_seed(rank)
    shard = torch.empty(r1 - r0, args.head_dim).normal_(0, 0.02, generator=gen)
    table = ShardedTable(plan, shard)
    del shard
    opt = SparseAdam([table.weight], lr=1e-3)
    target = torch.randn(plan.n_cols, args.head_dim, generator=gen)
    for step in range(args.steps):
        ids = torch.randint(
            0, 50_000, (args.batch, args.seq), generator=torch.Generator().manual_seed(step * 97 + rank)
        )
        rows = table(hasher(ids)[:, :, 0])
        ((rows - target) ** 2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = opt.state[table.weight]
    tensor_bytes = table.weight.numel() * 4 + sum(
        t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t)
    )
    full = layout.layer(1).num_embeddings * args.head_dim
    row = {
        "world": world,
        "rank": rank,
        "table_params": full,
        "shard_rows": r1 - r0,
        "state_rows": opt.state_rows(),
        "tensor_bytes_per_param": tensor_bytes / full,
        "rss_bytes_per_param": (rss() - before) / full,
    }
    Path(out, f"w{world}-r{rank}.json").write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--table-size", type=int, default=2_000_000, help="buckets per column (8 columns)")
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.world:
            mp.spawn(worker, args=(world, os.path.join(tmp, f"init{world}"), args, tmp), nprocs=world, join=True)
            rows += [json.loads(Path(tmp, f"w{world}-r{r}.json").read_text()) for r in range(world)]
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args), "ranks": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "train_sharded_bytes.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'world':>5} {'rank':>4} {'shard rows':>11} {'state rows':>10} {'tensor B/param':>14} {'RSS B/param':>11}")
    for r in rows:
        print(
            f"{r['world']:>5} {r['rank']:>4} {r['shard_rows']:>11,} {r['state_rows']:>10,} "
            f"{r['tensor_bytes_per_param']:>14.3f} {r['rss_bytes_per_param']:>11.3f}"
        )


if __name__ == "__main__":
    main()
