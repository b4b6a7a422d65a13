"""Serve the reference decoder tensor-parallel: its blocks and its Engram tables sharded over a group.

    torchrun --nproc-per-node 2 examples/tp_engram.py            # CPU: gloo (2 or 4 ranks)
    torchrun --nproc-per-node 2 examples/tp_engram.py --cuda     # one GPU per rank: NCCL

Each rank keeps its share of every block's attention heads and SwiGLU units
(`shard_backbone`: one all-reduce after the output and the down projections) and only its
shard of every Engram table (`EngramMemory(process_group=...)`: the rows completed by one
collective). Two prompts are prefilled as one packed batch into the paged cache and decoded
greedily for 8 tokens; every step's logits are checked against one process holding the whole
model and tables, and all ranks compute the same ones.
"""

from __future__ import annotations

import argparse
import copy
import os

import numpy as np
import torch
import torch.distributed as dist

from condmem import EngramConfig
from condmem.distributed import shard_backbone
from condmem.models import DecoderLM, ModelConfig
from condmem.serving import EngramMemory, ServingCache, decode_step, packed_ids, prefill_packed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cuda", action="store_true", help="one GPU per rank, NCCL")
    ap.add_argument("--mode", choices=["head", "row"], default="head", help="how the table rows are completed")
    args = ap.parse_args()
    dist.init_process_group("nccl" if args.cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.cuda else torch.device("cpu")
    ecfg = EngramConfig(
        layer_ids=[1, 2],
        max_ngram_size=3,
        n_heads=4,
        head_dim=32,
        table_size=997,
        hidden_size=128,
        compressed_vocab_size=200,
        short_conv=False,
    )
    cfg = ModelConfig(vocab_size=256, dim=128, n_layers=4, n_heads=8, n_kv_heads=4, engram=ecfg, max_seq_len=64)
    model = DecoderLM(cfg, token_lookup=np.arange(256) % 200, seed=0, device=device, sparse_tables=False).eval()
    tables = {b.layer_id: b.engram.table.weight.detach().bfloat16().float() for b in model.blocks if b.engram}
    with torch.no_grad():
        for b in model.blocks:
            if b.engram is not None:
                b.engram.table.weight.copy_(tables[b.layer_id])  # bf16-exact, as the memory stores them
    whole = copy.deepcopy(model)  # the one-process reference
    shard_backbone(model)
    memory = EngramMemory.from_weights(
        model.hasher,
        tables,
        "host",
        device,
        process_group=dist.group.WORLD,
        tp_mode=args.mode,
        max_sequences=2,
        host_alloc="pageable" if not args.cuda else "mmap_register",
    )
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (12, 7)]
    slots = [memory.allocate() for _ in prompts]
    cache, whole_cache = ServingCache(model, n_slots=2, max_len=64), ServingCache(whole, n_slots=2, max_len=64)
    ids, cu = packed_ids(prompts)
    on_device = [p.to(device) for p in prompts]
    tokens = []
    with torch.no_grad():
        logits = prefill_packed(
            model, cache, slots, on_device, prepared=memory.prepare_ragged(ids, cu, slots=torch.tensor(slots))
        )
        want = prefill_packed(whole, whole_cache, slots, on_device)
        for step in range(9):
            torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"step {step}: {m}")
            everyone = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, logits)
            assert all(torch.equal(e, logits) for e in everyone), "ranks computed different logits"
            if step == 8:
                break
            nxt = logits.argmax(-1)
            tokens.append(nxt.tolist())
            slot_t = torch.tensor(slots)
            logits = decode_step(model, cache, slot_t, nxt, prepared=memory.prepare_decode(slot_t, nxt))
            want = decode_step(whole, whole_cache, slot_t, nxt)
    if rank == 0:
        shard = {lid: memory.stores[lid].num_rows for lid in memory.layer_ids}
        total = {lid: model.layout.layer(lid).num_embeddings for lid in memory.layer_ids}
        attn = model.blocks[0].attn
        print(
            f"world {dist.get_world_size()}, mode {args.mode}: rank 0 holds {attn.n_heads} of {cfg.n_heads} heads, "
            f"{model.blocks[0].mlp.w1.weight.shape[0]} of {cfg.ffn_width(0)} SwiGLU units and {shard} of {total} "
            f"table rows; prefill + 8 decode steps equal to one process; tokens {list(zip(*tokens))}"
        )
    memory.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
