"""Continuous-batching decode for `DecoderLM`: cache rows are sequence slots, each at its own position.

`ServingCache` preallocates, per block, keys and values for ``n_slots`` sequences of up to
``max_len`` tokens, each slot's length, its token history and each Engram layer's
ShortConv state. Sequences join (`prefill` one prompt into a free slot) and leave
(`release`) between steps; `decode_step` advances any set of live slots by one token,
each at its own position (per-row RoPE angles, per-row attention masks).

Engram rows for a step come either from the model's own tables (hashing the last N-1
tokens of each slot's history) or, with ``prepared=``, from an `EngramMemory` lookup
started earlier (`EngramMemory.prepare_decode`, whose history slots should be the same
numbers as these cache slots).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from condmem.models.attention import _SDPA_GQA, KVCache
from condmem.models.layers import apply_rotary
from condmem.models.transformer import DecoderLM, InferenceCache, engram_update


class ServingCache:
    """Per-slot decoding state for up to `n_slots` concurrent sequences of `max_len` tokens."""

    def __init__(self, model: DecoderLM, n_slots: int, max_len: int | None = None, dtype: torch.dtype | None = None):
        cfg = model.cfg
        self.max_len = max_len or cfg.max_seq_len
        if self.max_len > cfg.max_seq_len:
            raise ValueError(f"max_len {self.max_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
        device = model.embed.weight.device
        dtype = dtype or model.embed.weight.dtype
        shape = (n_slots, cfg.n_kv_heads, self.max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in model.blocks]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in model.blocks]
        self.lengths = torch.zeros(n_slots, dtype=torch.long, device=device)
        self.tokens = torch.zeros(n_slots, self.max_len, dtype=torch.long, device=device)
        self.conv: dict[int, torch.Tensor | None] = {}
        for block in model.blocks:
            if block.engram is not None:
                sc = block.engram.short_conv
                self.conv[block.layer_id] = (None if sc is None else torch.zeros(
                    n_slots, (sc.kernel_size - 1) * sc.dilation, 1, cfg.dim, device=device, dtype=dtype))
        self.n_slots = n_slots

    def _row_cache(self, slot: int) -> InferenceCache:
        """An `InferenceCache` whose buffers are views of one slot (prefill writes land in place)."""
        kv = []
        for k, v in zip(self.k, self.v):
            view = KVCache.__new__(KVCache)
            torch.nn.Module.__init__(view)
            view.register_buffer("k", k[slot:slot + 1], persistent=False)
            view.register_buffer("v", v[slot:slot + 1], persistent=False)
            kv.append(view)
        conv = {lid: None if c is None else c[slot:slot + 1] for lid, c in self.conv.items()}
        return InferenceCache(kv=kv, conv=conv, tokens=self.tokens[slot:slot + 1], length=0)

    def release(self, slot: int) -> None:
        """Forget a finished sequence (its slot is reset; the next prefill overwrites it)."""
        self.lengths[slot] = 0
        for c in self.conv.values():
            if c is not None:
                c[slot].zero_()


@torch.no_grad()
def prefill(model: DecoderLM, cache: ServingCache, slot: int, ids: torch.Tensor, prepared=None) -> torch.Tensor:
    """Run prompt `ids` [T] into `slot` (which must be empty); returns logits [T, vocab]."""
    if int(cache.lengths[slot]) != 0:
        raise ValueError(f"slot {slot} holds a live sequence; release it first")
    cache.release(slot)
    logits = model(ids[None].to(cache.tokens.device), cache=cache._row_cache(slot), prepared=prepared)[0]
    cache.lengths[slot] = ids.numel()
    return logits


@torch.no_grad()
def decode_step(model: DecoderLM, cache: ServingCache, slots: torch.Tensor, ids: torch.Tensor,
                prepared=None, check: bool = True) -> torch.Tensor:
    """One new token per live slot: ids [B] for slots [B] (distinct); returns logits [B, vocab].

    `check=False` skips the cache-full test (a host sync), e.g. inside a CUDA graph.
    """
    cfg = model.cfg
    device = cache.tokens.device
    slots, ids = slots.to(device), ids.to(device)
    pos = cache.lengths[slots]                                    # [B] position of the new token
    if check and bool((pos >= cache.max_len).any()):
        raise ValueError(f"a sequence reached the cache's {cache.max_len} positions")
    cache.tokens[slots, pos] = ids
    batch = ids.numel()
    x = model.embed(ids)[:, None]                                 # [B, 1, D]
    cos = model.rotary.cos[pos][:, None, None, :]                 # [B, 1, 1, hd/2]
    sin = model.rotary.sin[pos][:, None, None, :]
    rows_all = None
    if cfg.engram is not None and prepared is None:
        # Each slot's last N tokens; look-backs before its start are blocked (read as pad).
        n = cfg.engram.max_ngram_size
        back = pos[:, None] - torch.arange(n - 1, -1, -1, device=device)[None, :]        # [B, N]
        window = cache.tokens[slots[:, None], back.clamp(min=0)]
        rows_all = model.hasher(window, blocked=back < 0, check=False)[:, -1:]          # [B, 1, L, C]
    keys_seen = torch.arange(cache.max_len, device=device)[None, :] <= pos[:, None]    # [B, max_len]
    slot_index = 0
    for i, block in enumerate(model.blocks):
        if block.engram is not None:
            lid = block.layer_id
            if prepared is not None:
                rows, looked_up = prepared.row_ids(lid), prepared.rows(lid)
            else:
                rows, looked_up = rows_all[:, :, slot_index], None
            slot_index += 1
            conv = cache.conv[lid]
            state = None if conv is None else conv[slots]
            x = x + engram_update(block.engram, x, rows, state, looked_up=looked_up)
            if conv is not None:
                conv[slots] = state
        attn = block.attn
        h = block.attn_norm(x)
        q = attn.wq(h).view(batch, 1, attn.n_heads, attn.head_dim).transpose(1, 2)
        k = attn.wk(h).view(batch, 1, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.wv(h).view(batch, 1, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        cache.k[i][slots, :, pos] = k[:, :, 0].to(cache.k[i].dtype)
        cache.v[i][slots, :, pos] = v[:, :, 0].to(cache.v[i].dtype)
        keys, values = cache.k[i][slots].to(q.dtype), cache.v[i][slots].to(q.dtype)
        if attn.n_kv_heads != attn.n_heads and not _SDPA_GQA:
            rep = attn.n_heads // attn.n_kv_heads
            keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        kwargs = {"enable_gqa": True} if attn.n_kv_heads != attn.n_heads and _SDPA_GQA else {}
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=keys_seen[:, None, None, :], **kwargs)
        x = x + attn.wo(y.transpose(1, 2).reshape(batch, 1, -1))
        x = x + block.mlp(block.mlp_norm(x))
    cache.lengths[slots] = pos + 1
    return model.lm_head(model.norm(x))[:, 0]
