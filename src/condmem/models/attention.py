"""Grouped-query causal self-attention: its projections, its dense backend and KV cache.

`Attention` holds the projections (``wq``, ``wk``, ``wv``, ``wo``); the attention itself is a
backend the forward context supplies (`condmem.models.context`): `DenseAttention` here for
dense [B, T] batches (training, evaluation, `generate`), the paged backends of
`condmem.serving.steps` for serving. The dense backend reads and writes the cache through one
small interface (`KVCache.update`); the cache is static in shape (buffers of ``max_len``
positions) and hands attention the filled prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from condmem.models.layers import apply_rotary, joined_weight

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
    """The projections of causal self-attention with RoPE and grouped-query heads.

    `qkv` projects normed hidden states to queries, keys and values; the forward context's
    backend attends (`DenseAttention`, or a paged one); ``wo`` projects the result back.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, device=None, dtype=None):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False, device=device, dtype=dtype)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False, device=device, dtype=dtype)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False, device=device, dtype=dtype)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False, device=device, dtype=dtype)

    def qkv(self, h: torch.Tensor, *, joined: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [B, T, H, hd], keys and values [B, T, KV, hd] (views) of normed hidden states h [B, T, D].

        `joined`: one GEMM over the three projections' stacked weight (`joined_weight`; inference),
        else the three modules (what autograd differentiates)."""
        lead, hd = h.shape[:-1], self.head_dim
        if not joined:
            q = self.wq(h).view(*lead, self.n_heads, hd)
            k = self.wk(h).view(*lead, self.n_kv_heads, hd)
            v = self.wv(h).view(*lead, self.n_kv_heads, hd)
            return q, k, v
        qkv = F.linear(h.reshape(-1, h.shape[-1]), joined_weight(self, (self.wq, self.wk, self.wv)))
        nq, nkv = self.n_heads * hd, self.n_kv_heads * hd
        q = qkv[:, :nq].view(*lead, self.n_heads, hd)
        k = qkv[:, nq : nq + nkv].view(*lead, self.n_kv_heads, hd)
        v = qkv[:, nq + nkv :].view(*lead, self.n_kv_heads, hd)
        return q, k, v


def _flex_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of q [B, H, T, hd] over k, v [B, KV, T, hd] by FlexAttention: kernels that
    Inductor generates inside the compiled block, reading the shared K/V heads in place, whose
    backward adds in a fixed order. SDPA's flash backward is nondeterministic, and in deterministic
    mode it runs a slower form (dq in a separate pass) after copying each K/V head to its queries,
    then sums those heads' gradients back; cuDNN's is not offered at all."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    length = q.shape[2]
    blocks = create_block_mask(_causal, None, None, length, length, device=q.device)
    return flex_attention(q, k, v, block_mask=blocks, enable_gqa=k.shape[1] != q.shape[1])


def _causal(batch, head, q_idx, kv_idx):
    return q_idx >= kv_idx


class DenseAttention:
    """Causal attention over dense [B, T] batches: RoPE at positions ``start..start+T-1``, then
    SDPA over the whole sequence or, with `kv` (one `KVCache` per block), over the cached keys
    and these (stored first)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, kv: list | None = None, start: int = 0):
        self.cos, self.sin, self.kv, self.start = cos, sin, kv, start

    def __call__(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch, length, n_heads, _ = q.shape
        n_kv = k.shape[2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)
        start = self.start
        if self.kv is not None:
            k, v = self.kv[i].update(start, k, v)
            k, v = k.to(q.dtype), v.to(q.dtype)
        mask, causal = None, True
        if k.shape[2] != length:
            causal = False
            if length > 1:  # a chunk after a cached prefix: query i sees keys 0..start+i
                q_pos = torch.arange(start, start + length, device=q.device)
                mask = torch.arange(k.shape[2], device=q.device)[None, :] <= q_pos[:, None]
        if mask is None and causal and q.is_cuda and torch.compiler.is_compiling():
            y = _flex_causal(q, k, v)
            return y.transpose(1, 2).reshape(batch, length, -1)
        if n_kv != n_heads and not _SDPA_GQA:
            rep = n_heads // n_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        kwargs = {"enable_gqa": True} if n_kv != n_heads and _SDPA_GQA else {}
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, **kwargs)
        return y.transpose(1, 2).reshape(batch, length, -1)
