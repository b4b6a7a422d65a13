"""A tiny Engram LM for runtime tests: two Engram layers, ShortConv on, bf16-exact tables."""

from __future__ import annotations

import numpy as np
import torch

from condmem import EngramConfig
from condmem.models.config import ModelConfig, MoEConfig
from condmem.models.transformer import DecoderLM


def tiny_engram_lm(device, short_conv: bool = True, moe: bool = False):
    """(model, {layer_id: table weight}); table values are bf16-representable so host rows match exactly.
    `moe`: routed experts in every block (6 of width 32, top-2) beside the shared MLP."""
    ecfg = EngramConfig(
        layer_ids=[1, 2],
        max_ngram_size=3,
        n_heads=2,
        head_dim=16,
        table_size=97,
        hidden_size=64,
        compressed_vocab_size=40,
        short_conv=short_conv,
    )
    cfg = ModelConfig(
        vocab_size=50,
        dim=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        engram=ecfg,
        max_seq_len=128,
        moe=MoEConfig(n_experts=6, top_k=2, expert_hidden=32) if moe else None,
    )
    model = DecoderLM(cfg, token_lookup=np.arange(50) % 40, sparse_tables=False).to(device).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for block in model.blocks:
            if block.engram is not None:
                w = block.engram.table.weight
                # bf16-exact values, so host rows (bf16) and the fp32 module table agree bit for bit.
                w.copy_(w.bfloat16().float())
                if block.engram.short_conv is not None:
                    block.engram.short_conv.weight.copy_(
                        torch.randn(block.engram.short_conv.weight.shape, generator=gen)
                    )
    tables = {b.layer_id: b.engram.table.weight for b in model.blocks if b.engram is not None}
    return model, tables


def sharpen_attention(model, factor: float = 8.0) -> None:
    """Scale the query and key projections: a fresh init attends almost uniformly, which would
    hide a position or masking error in a serving test."""
    with torch.no_grad():
        for block in model.blocks:
            block.attn.wq.weight.mul_(factor)
            block.attn.wk.weight.mul_(factor)


@torch.no_grad()
def greedy_tokens(model, prompt: list[int], n: int, device) -> list[int]:
    """The next `n` greedy tokens after `prompt`, each from a full forward over the sequence so far."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq], device=device))[0, -1].argmax()))
    return seq[len(prompt) :]
