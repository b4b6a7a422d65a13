"""Attention over a paged KV cache: split-KV decode, varlen causal prefill, RoPE + cache store.

The cache of one layer is a pool of fixed-size blocks, ``[n_blocks, block_size, n_kv_heads,
head_dim]``, and each sequence owns the blocks its block-table row lists (as serving engines
keep it): position p of row b is block ``block_table[b, p // block_size]``, offset
``p % block_size``. The pool may be any strided view with unit stride in its last dimension
(`ServingCache` stores each block heads-outer and passes a transposed view), since the
kernels address it through its strides. Lengths are device tensors and every launch has a fixed grid, so a decode
step is captured in a CUDA graph as is, and reads only the keys each sequence holds.

Each function picks the Triton kernel (`condmem.ops.attention.triton`) for CUDA tensors and
the fp32 reference (`condmem.ops.attention.reference`) elsewhere; ``backend=`` forces either
(``"triton"`` on CPU runs the interpreter, ``TRITON_INTERPRET=1``).

Example:
    >>> q_rot = rope_store(q, k, v, cos, sin, pos, slots, block_table, k_pool, v_pool)
    >>> y = paged_decode_attention(q_rot, k_pool, v_pool, block_table, lengths)    # [B, H, D]
"""

from __future__ import annotations

import torch

from condmem.ops.attention import reference
from condmem.ops.triton_util import resolve_backend


def _check_pools(k_pool: torch.Tensor, v_pool: torch.Tensor, what: str) -> None:
    """The kernels address both pools with k_pool's strides: same shape, same strides, unit last stride."""
    if k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(
            f"{what}: k_pool and v_pool must both be [n_blocks, block_size, KV, D], "
            f"got {tuple(k_pool.shape)} and {tuple(v_pool.shape)}"
        )
    if k_pool.stride() != v_pool.stride() or k_pool.stride(-1) != 1:
        raise ValueError(
            f"{what}: k_pool and v_pool need the same strides with a unit last stride, "
            f"got {k_pool.stride()} and {v_pool.stride()}"
        )


def _backend(backend: str | None, q: torch.Tensor, what: str) -> str:
    chosen = resolve_backend(backend, q.device, what)
    head_dim = q.shape[-1]
    if chosen == "triton" and (head_dim < 2 or head_dim % 2):
        raise ValueError(f"{what}: the Triton kernels need an even head_dim, got {head_dim}")
    return chosen


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    *,
    scale: float | None = None,
    n_splits: int | None = None,
    backend: str | None = "auto",
) -> torch.Tensor:
    """One query per sequence over the first ``lengths[b]`` keys of its paged cache.

    Args:
        q: [B, H, D] queries (H a multiple of the cache's KV heads: grouped-query heads).
        k_pool, v_pool: [n_blocks, block_size, KV, D] the layer's cache.
        block_table: int32 [B, max_blocks] blocks of each sequence, in position order.
        lengths: [B] keys to attend to (0: the output row is zeros).
        scale: softmax scale, default 1/sqrt(D).
        n_splits: splits of the positions per (sequence, KV head) (Triton; default: enough
            programs to fill the GPU).

    Returns:
        [B, H, D] in q's dtype.
    """
    _check_pools(k_pool, v_pool, "paged_decode_attention")
    if _backend(backend, q, "paged_decode_attention") == "torch":
        return reference.paged_decode_attention_ref(q, k_pool, v_pool, block_table, lengths, scale)
    from condmem.ops.attention import triton as kernels

    return kernels.paged_decode_attention(q, k_pool, v_pool, block_table, lengths, scale, n_splits)


def decode_attention_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    *,
    scale: float | None = None,
    backend: str | None = "auto",
) -> torch.Tensor:
    """A decode step's attention with its RoPE and cache store: row b's new token sits at
    position ``lengths[b] - 1``; its q [B, H, D] and k [B, KV, D] are rotated by that position's
    angle, k and v stored there (rows with ``lengths[b] == 0`` store nothing and return zeros),
    then the rotated q attends to the first ``lengths[b]`` keys. The same numbers as `rope_store`
    (pos ``lengths - 1``, block-table row b) followed by `paged_decode_attention`, in one
    launch on CUDA.
    """
    _check_pools(k_pool, v_pool, "decode_attention_rope_store")
    if _backend(backend, q, "decode_attention_rope_store") == "torch":
        rows = torch.arange(q.shape[0], device=q.device)
        lengths = lengths.to(q.device)
        q_rot = reference.rope_store_ref(
            q, k, v, cos, sin, (lengths - 1).clamp(min=0), rows, block_table, k_pool, v_pool, lengths > 0
        )
        return reference.paged_decode_attention_ref(q_rot, k_pool, v_pool, block_table, lengths, scale)
    from condmem.ops.attention import triton as kernels

    return kernels.paged_decode_attention(q, k_pool, v_pool, block_table, lengths, scale, rope=(k, v, cos, sin))


def paged_prefill_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    max_q_len: int,
    *,
    scale: float | None = None,
    backend: str | None = "auto",
) -> torch.Tensor:
    """Causal attention of a packed batch of chunks (no padding tokens) over their paged caches.

    Args:
        q: [N, H, D] queries; chunk b owns rows ``cu_seqlens[b]:cu_seqlens[b+1]``.
        k_pool, v_pool: [n_blocks, block_size, KV, D]; every chunk's own keys already stored
            (`rope_store`) behind the ``starts[b]`` keys its sequence held before it.
        block_table: int32 [B, max_blocks], row b for chunk b.
        cu_seqlens: int32 [B+1] chunk boundaries.
        starts: int32 [B] position of each chunk's first token (0 for a whole prompt).
        max_q_len: the longest chunk (a host int: it sizes the grid).

    Returns:
        [N, H, D] in q's dtype; query j of chunk b attends to keys 0..starts[b]+j.
    """
    _check_pools(k_pool, v_pool, "paged_prefill_attention")
    if _backend(backend, q, "paged_prefill_attention") == "torch":
        return reference.paged_prefill_attention_ref(q, k_pool, v_pool, block_table, cu_seqlens, starts, scale)
    from condmem.ops.attention import triton as kernels

    return kernels.paged_prefill_attention(q, k_pool, v_pool, block_table, cu_seqlens, starts, max_q_len, scale)


def rope_store(
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
    *,
    backend: str | None = "auto",
) -> torch.Tensor:
    """Rotate q and k by each token's RoPE angle and write k, v into the paged cache.

    Args:
        q: [N, H, D]; k, v: [N, KV, D] (last dimension contiguous).
        cos, sin: fp32 [max_pos, D/2] RoPE tables (`condmem.models.layers.Rotary`).
        pos: [N] each token's position; slot_of: [N] its block-table row.
        block_table: int32 [n_rows, max_blocks].
        k_pool, v_pool: [n_blocks, block_size, KV, D], written in place.
        valid: optional bool [N]; rows marked False write nothing (fixed-shape graph padding).

    Returns:
        The rotated q [N, H, D] (fp32 maths, q's dtype), as `condmem.models.layers.apply_rotary`.
    """
    _check_pools(k_pool, v_pool, "rope_store")
    if _backend(backend, q, "rope_store") == "torch":
        return reference.rope_store_ref(q, k, v, cos, sin, pos, slot_of, block_table, k_pool, v_pool, valid)
    from condmem.ops.attention import triton as kernels

    return kernels.rope_store(q, k, v, cos, sin, pos, slot_of, block_table, k_pool, v_pool, valid)


__all__ = ["decode_attention_rope_store", "paged_decode_attention", "paged_prefill_attention", "rope_store"]
