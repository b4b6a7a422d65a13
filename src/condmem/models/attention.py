"""Grouped-query causal self-attention and its KV cache.

Attention reads and writes the cache through one small interface (`KVCache.update`),
so a static, preallocated cache for compiled decoding can replace this one without
touching the block code. The cache here is already static in shape (buffers of
``max_len`` positions); it hands attention the filled prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from condmem.models.layers import apply_rotary

# `enable_gqa` lets SDPA read shared K/V heads without copying them (torch >= 2.5).
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


class KVCache(nn.Module):
    """Keys and values of one attention layer for `batch` sequences of up to `max_len` tokens.

    Shapes: buffers [batch, n_kv_heads, max_len, head_dim].
    """

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, device=None, dtype=torch.float32):
        super().__init__()
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def update(self, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, n_kv, T, hd] at positions start_pos.. and return keys/values 0..start_pos+T-1."""
        end = start_pos + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, asked to write up to {end}")
        self.k[: k.shape[0], :, start_pos:end] = k.to(self.k.dtype)
        self.v[: v.shape[0], :, start_pos:end] = v.to(self.v.dtype)
        return self.k[: k.shape[0], :, :end], self.v[: v.shape[0], :, :end]


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, keys_seen: torch.Tensor
) -> torch.Tensor:
    """Attention of one new query per sequence over its cached keys (grouped-query heads).

    Args:
        q: [B, H, 1, hd] queries.
        keys, values: [B, KV, L, hd] cached keys/values (KV divides H).
        keys_seen: bool [B, L], True where a sequence's query may look (its positions so far).

    Returns:
        [B, H, 1, hd].

    The H/KV query heads that share a key head are folded into the query-length axis
    ([B, KV, H/KV, hd] against [B, KV, L, hd]), so a fused attention kernel reads each
    cached key once and nothing is repeated per query head: a decode step is bound by
    reading the cache, and SDPA's GQA fallbacks (which copy K and V per head when a mask
    is given) would multiply that.
    """
    batch, n_heads, _, head_dim = q.shape
    n_kv = keys.shape[1]
    grouped = q.reshape(batch, n_kv, n_heads // n_kv, head_dim)  # [B, KV, rep, hd]
    y = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=keys_seen[:, None, None, :])
    return y.reshape(batch, n_heads, 1, head_dim)


class Attention(nn.Module):
    """Causal self-attention with RoPE and grouped-query heads (scaled_dot_product_attention)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, device=None, dtype=None):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False, device=device, dtype=dtype)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False, device=device, dtype=dtype)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False, device=device, dtype=dtype)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False, device=device, dtype=dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None, start_pos: int = 0
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.wq(x).view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(start_pos, k, v)
            k, v = k.to(q.dtype), v.to(q.dtype)
        mask, causal = None, True
        if k.shape[2] != length:
            causal = False
            if length > 1:  # a chunk after a cached prefix: query i sees keys 0..start_pos+i
                q_pos = torch.arange(start_pos, start_pos + length, device=x.device)
                mask = torch.arange(k.shape[2], device=x.device)[None, :] <= q_pos[:, None]
        if self.n_kv_heads != self.n_heads and not _SDPA_GQA:
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        kwargs = {"enable_gqa": True} if self.n_kv_heads != self.n_heads and _SDPA_GQA else {}
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, **kwargs)
        return self.wo(y.transpose(1, 2).reshape(batch, length, -1))
