"""Serve the reference decoder with its Engram tables sharded over a tensor-parallel group.

    torchrun --nproc-per-node 2 examples/tp_engram.py            # CPU: gloo
    torchrun --nproc-per-node 2 examples/tp_engram.py --cuda     # one GPU per rank: NCCL

Each rank holds only its shard of every Engram table (`EngramMemory(process_group=...)`);
`prepared.rows(layer)` completes the rows with one all-gather. The backbone is replicated
here (condmem shards Engram, not attention or the MLPs), so every rank computes the same
logits: rank 0 checks them against one process holding the whole table, and greedy-decodes.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.distributed as dist

from condmem import EngramConfig
from condmem.models import DecoderLM, ModelConfig
from condmem.runtime import EngramMemory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cuda", action="store_true", help="one GPU per rank, NCCL")
    ap.add_argument("--mode", choices=["head", "row"], default="head")
    args = ap.parse_args()
    dist.init_process_group("nccl" if args.cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.cuda else torch.device("cpu")
    ecfg = EngramConfig(layer_ids=[1, 2], max_ngram_size=3, n_heads=4, head_dim=32, table_size=997, hidden_size=128,
                        compressed_vocab_size=200)
    cfg = ModelConfig(vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, engram=ecfg, max_seq_len=64)
    model = DecoderLM(cfg, token_lookup=np.arange(256) % 200, seed=0, device=device).eval()
    tables = {b.layer_id: b.engram.table.weight.detach().bfloat16().float() for b in model.blocks if b.engram}
    with torch.no_grad():
        for b in model.blocks:
            if b.engram is not None:
                b.engram.table.weight.copy_(tables[b.layer_id])  # bf16-exact, as the memory stores them
    memory = EngramMemory.from_weights(model.hasher, tables, "host", device, process_group=dist.group.WORLD,
                                       tp_mode=args.mode, host_alloc="pageable" if not args.cuda else "mmap_register")
    shard = {lid: memory.stores[lid].num_rows for lid in memory.layer_ids}
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for _ in range(8):
            logits = model(ids.to(device), prepared=memory.prepare(ids))
            whole = model(ids.to(device))
            assert torch.allclose(logits, whole, atol=1e-5), "sharded rows gave other logits"
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True).cpu()], dim=1)
    if rank == 0:
        total = {lid: model.layout.layer(lid).num_embeddings for lid in memory.layer_ids}
        print(f"world {dist.get_world_size()}, mode {args.mode}: rank 0 holds {shard} of {total} rows; "
              f"8 greedy steps equal to the unsharded model; tokens {ids[0, 12:].tolist()}")
    memory.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
