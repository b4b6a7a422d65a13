"""Plain-PyTorch references of the paged attention ops (fp32 maths, obviously right).

The paged KV cache of one layer is a pool of blocks, ``[n_blocks, block_size, n_kv_heads,
head_dim]``; sequence b's position p lives in block ``block_table[b, p // block_size]`` at
offset ``p % block_size``. These functions gather each sequence's keys through its block-table
row into a dense, masked view and compute attention in fp32; the Triton kernels in
`condmem.ops.attention.triton` are held to them.
"""

from __future__ import annotations

import math

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half convention, fp32 maths, x's dtype out (as `condmem.models.layers.apply_rotary`)."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def gather_paged(pool: torch.Tensor, block_table: torch.Tensor, n_pos: int) -> torch.Tensor:
    """Positions 0..n_pos-1 of every block-table row: [B, n_pos, n_kv_heads, head_dim]."""
    block_size = pool.shape[1]
    pos = torch.arange(n_pos, device=pool.device)
    blocks = block_table[:, pos // block_size].long()  # [B, n_pos]
    return pool[blocks, (pos % block_size)[None, :]]


def _attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [T, H, D] over keys/values [L, KV, D] where allowed [T, L]; fp32 [T, H, D] (0 for rows with no key)."""
    n_heads, n_kv = q.shape[1], keys.shape[1]
    rep = n_heads // n_kv
    k = keys.float().repeat_interleave(rep, dim=1)  # [L, H, D]
    v = values.float().repeat_interleave(rep, dim=1)
    scores = torch.einsum("thd,lhd->htl", q.float(), k) * scale
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no key: all -inf -> 0
    return torch.einsum("htl,lhd->thd", probs, v)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One query per sequence over its first ``lengths[b]`` cached keys; [B, H, D] in q's dtype."""
    batch, _, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    n_pos = block_table.shape[1] * k_pool.shape[1]
    keys, values = gather_paged(k_pool, block_table, n_pos), gather_paged(v_pool, block_table, n_pos)
    allowed = torch.arange(n_pos, device=q.device)[None, :] < lengths.to(q.device)[:, None]  # [B, L]
    out = torch.stack([_attend(q[b : b + 1], keys[b], values[b], allowed[b : b + 1], scale)[0] for b in range(batch)])
    return out.to(q.dtype)


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of packed chunks; chunk b's query j sits at ``starts[b] + j`` and sees keys
    0..starts[b]+j of block-table row b (already in the pool). [N, H, D] in q's dtype."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cu, st = cu_seqlens.tolist(), starts.tolist()
    for b in range(len(cu) - 1):
        n = cu[b + 1] - cu[b]
        if n == 0:
            continue
        n_keys = st[b] + n
        keys = gather_paged(k_pool, block_table[b : b + 1], n_keys)[0]
        values = gather_paged(v_pool, block_table[b : b + 1], n_keys)[0]
        q_pos = st[b] + torch.arange(n, device=q.device)
        allowed = torch.arange(n_keys, device=q.device)[None, :] <= q_pos[:, None]
        out[cu[b] : cu[b + 1]] = _attend(q[cu[b] : cu[b + 1]], keys, values, allowed, scale)
    return out.to(q.dtype)


def rope_store_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    slot_of: torch.Tensor,
    block_table: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q [N, H, D] and k [N, KV, D] by their positions' RoPE angles (cos/sin tables
    [max_pos, D/2]); store k and v [N, KV, D] at (slot_of[n], pos[n]) of the paged cache, except
    rows where `valid` is False. Returns the rotated q."""
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    q_rot = apply_rotary(q, c, s)
    k_rot = apply_rotary(k, c, s)
    block_size = k_pool.shape[1]
    blocks = block_table[slot_of, pos // block_size].long()
    offsets = pos % block_size
    if valid is None:
        k_pool[blocks, offsets] = k_rot.to(k_pool.dtype)
        v_pool[blocks, offsets] = v.to(v_pool.dtype)
    else:
        keep = valid.view(-1, 1, 1)
        k_pool[blocks, offsets] = torch.where(keep, k_rot.to(k_pool.dtype), k_pool[blocks, offsets])
        v_pool[blocks, offsets] = torch.where(keep, v.to(v_pool.dtype), v_pool[blocks, offsets])
    return q_rot
