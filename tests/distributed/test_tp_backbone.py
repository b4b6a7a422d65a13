"""Tensor-parallel serving backbone on gloo (spawned CPU ranks): a decoder whose heads and SwiGLU
units are split by `shard_backbone`, served through the paged cache (packed prefill, decode
steps, a ragged step mixing a new prompt with decode tokens), equals one process: logits
within fp32 tolerance, the same greedy tokens, and the same logits on every rank. With the
Engram table whole in the model, or sharded over the same group by `EngramMemory` (both modes)."""

from __future__ import annotations

import dataclasses

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist

from condmem import EngramConfig
from condmem.distributed import ShardingError, backbone_slices, shard_backbone
from condmem.models.config import ModelConfig
from condmem.serving import ServingCache, decode_step, packed_ids, prefill_packed, ragged_step
from condmem.models.transformer import DecoderLM
from ranks import spawn_ranks

VOCAB = 50


def _config(n_kv_heads: int = 4) -> ModelConfig:
    ecfg = EngramConfig(
        layer_ids=[1],
        max_ngram_size=3,
        n_heads=2,
        head_dim=16,
        table_size=97,
        hidden_size=64,
        compressed_vocab_size=40,
        short_conv=False,
    )
    return ModelConfig(
        vocab_size=VOCAB,
        dim=64,
        n_layers=3,
        n_heads=8,
        n_kv_heads=n_kv_heads,
        ffn_hidden=96,
        max_seq_len=64,
        engram=ecfg,
    )


def _model() -> DecoderLM:
    model = DecoderLM(_config(), token_lookup=np.arange(VOCAB) % 40, sparse_tables=False, seed=0).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.wq.weight.mul_(6.0)  # sharp attention: a wrong key or position shows
            block.attn.wk.weight.mul_(6.0)
            if block.engram is not None:  # bf16-exact, so rows from a memory equal the module's
                block.engram.table.weight.copy_(block.engram.table.weight.bfloat16().float())
    return model


@torch.no_grad()
def _serve(model: DecoderLM, memory=None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Packed prefill of three prompts, four greedy decode steps, then one ragged step: a new
    prompt in slot 1 beside one decode token for slots 2 and 0. (logits of each call, tokens)."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (7, 3, 11)]
    slots = [2, 0, 3]
    cache = ServingCache(model, n_slots=4, max_len=32, block_size=4)
    prepared = None
    if memory is not None:
        ids, cu = packed_ids(prompts)
        prepared = memory.prepare_ragged(ids, cu, slots=torch.tensor(slots))
    logits = [prefill_packed(model, cache, slots, prompts, prepared=prepared)]
    tokens = []
    for _ in range(4):
        nxt = logits[-1].argmax(-1)
        tokens.append(nxt)
        prep = None if memory is None else memory.prepare_decode(torch.tensor(slots), nxt)
        logits.append(decode_step(model, cache, torch.tensor(slots), nxt, prepared=prep))
    nxt = logits[-1].argmax(-1)
    tokens.append(nxt)
    chunks = [torch.randint(0, VOCAB, (5,), generator=gen), nxt[0:1], nxt[1:2]]
    ragged_slots = [1, 2, 0]
    prep = None
    if memory is not None:
        ids, cu = packed_ids(chunks)
        prep = memory.prepare_ragged(ids, cu, slots=torch.tensor(ragged_slots))
    logits.append(ragged_step(model, cache, ragged_slots, chunks, prepared=prep))
    return logits, tokens


def _worker(rank: int, world: int, init_file: str) -> None:
    from condmem.serving import EngramMemory

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        full = _model()
        want, want_tokens = _serve(full)
        for tables in (None, "head", "row"):  # whole in the model, or sharded by a memory in each mode
            model = shard_backbone(copy.deepcopy(full))
            assert model.blocks[0].attn.n_heads == 8 // world and model.blocks[0].attn.n_kv_heads == 4 // world
            assert model.blocks[0].mlp.w2.weight.shape == (64, 96 // world)
            assert "_joined_weight" not in model.blocks[0].attn.__dict__  # no whole joined weight kept
            memory = None
            if tables is not None:  # the table sharded over the same group: rows completed by its collective
                table = {1: model.blocks[1].engram.table.weight}
                memory = EngramMemory.from_weights(
                    model.hasher,
                    table,
                    "host",
                    "cpu",
                    host_alloc="pageable",
                    max_sequences=4,
                    process_group=dist.group.WORLD,
                    tp_mode=tables,
                )
                for _ in range(4):
                    memory.allocate()  # history slots numbered like the cache slots
            got, got_tokens = _serve(model, memory)
            for step, (g, w) in enumerate(zip(got, want)):
                torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-5, msg=lambda m: f"call {step}: {m}")
            assert all(torch.equal(a, b) for a, b in zip(got_tokens, want_tokens))
            for g in got:  # every rank holds the same logits, bit for bit
                others = [torch.empty_like(g) for _ in range(world)]
                dist.all_gather(others, g)
                assert all(torch.equal(o, g) for o in others)
            with pytest.raises(RuntimeError, match="sharded for tensor-parallel serving"):
                model(torch.zeros(1, 3, dtype=torch.long))
            if memory is not None:
                memory.close()
        dist.barrier()  # no rank tears down gloo while another still talks to it
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_backbone_serves_like_one_process(world, tmp_path):
    spawn_ranks(_worker, world, tmp_path / "init")


def test_slices_keep_grouped_heads_together_and_refuse_uneven_splits():
    cfg = _config()
    s = backbone_slices(cfg, 4, 3)
    assert s.q_heads == (6, 8) and s.kv_heads == (3, 4) and s.ffn_units == [(72, 96)] * 3
    with pytest.raises(ShardingError, match="4 KV heads do not split over 8 ranks"):
        backbone_slices(cfg, 8, 0)
    with pytest.raises(ShardingError, match="96 SwiGLU units do not split over 5 ranks"):
        backbone_slices(
            ModelConfig(vocab_size=VOCAB, dim=80, n_layers=1, n_heads=10, n_kv_heads=5, ffn_hidden=96), 5, 0
        )


def test_a_model_with_routed_experts_is_refused():
    """Negative control beside it: the same config without experts splits."""
    from condmem.models.config import MoEConfig

    cfg = ModelConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64)
    assert backbone_slices(cfg, 2, 0).q_heads == (0, 2)
    moe = dataclasses.replace(cfg, moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=32))
    with pytest.raises(ShardingError, match="routed experts"):
        backbone_slices(moe, 2, 0)


def test_the_tensor_parallel_example_runs_on_two_gloo_ranks():
    """`examples/tp_engram.py` under torchrun: its own checks (every step against one process,
    ranks equal) pass."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(root / "examples" / "tp_engram.py"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "prefill + 8 decode steps equal to one process" in done.stdout
