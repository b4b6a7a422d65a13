"""The n-gram hash in plain, vectorized PyTorch: the reference every kernel is held to.

Given compressed ids ``c`` [B, T], for every position t, Engram layer l and column
(order n, head h)::

    mix_2 = (c[t] * m[0]) ^ (c[t-1] * m[1])
    mix_n = mix_{n-1} ^ (c[t-n+1] * m[n-1])
    bucket = mix_n % prime[l, n, h]          row = bucket + offset[l, n, h]

A look-back before the sequence start reads the pad's compressed id; so does one that
reaches a blocked position or passes it (the block cascades to every older position).
Products stay below 2**63 by construction of the multipliers, so every mix is
non-negative and C-style and Python-style modulo agree: the same numbers come out of
this code on any device and out of the Triton kernels.

There is no Python loop over tokens; the loops run over the N-1 look-back distances.
"""

from __future__ import annotations

import torch


def shifted_history(
    compressed: torch.Tensor, max_ngram_size: int, pad_id: int, blocked: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, T] compressed ids -> [B, T, N] where [..., k] is the id k positions back (pad where unseen).

    Args:
        compressed: int64 [B, T] compressed ids.
        max_ngram_size: N; distances 0..N-1 are produced.
        pad_id: compressed id used before the sequence start and behind a blocked position.
        blocked: optional bool [B, T]; a look-back (distance >= 1) that reaches a blocked
            position, or any position older than one, reads `pad_id`. Distance 0 (the
            token itself) is always the token.
    """
    batch, length = compressed.shape
    columns = [compressed]
    dead = None
    for k in range(1, max_ngram_size):
        pad = compressed.new_full((batch, min(k, length)), pad_id)
        back = torch.cat([pad, compressed[:, : length - k]], dim=1) if k < length else pad
        if blocked is not None:
            reached = (
                torch.cat([blocked.new_zeros((batch, min(k, length))), blocked[:, : length - k]], dim=1)
                if k < length
                else blocked.new_zeros((batch, length))
            )
            dead = reached if dead is None else dead | reached
            back = torch.where(dead, torch.full_like(back, pad_id), back)
        columns.append(back)
    return torch.stack(columns, dim=-1)


def ngram_mixes(history: torch.Tensor, multipliers: torch.Tensor) -> torch.Tensor:
    """[B, T, N] history x [L, N] multipliers -> [B, T, L, N-1] mixes for orders 2..N."""
    products = history[:, :, None, :] * multipliers[None, None, :, :]
    mixes = []
    mix = products[..., 0]
    for k in range(1, multipliers.shape[-1]):
        mix = mix ^ products[..., k]
        mixes.append(mix)
    return torch.stack(mixes, dim=-1)


def hash_reference(
    compressed: torch.Tensor,
    *,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor | None,
    n_heads: int,
    pad_id: int,
    blocked: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row ids (or bucket ids when `offsets` is None) for every Engram layer.

    Args:
        compressed: int64 [B, T] compressed token ids.
        multipliers: int64 [L, N].
        primes: int64 [L, (N-1)*H], columns in (order, head) order.
        offsets: int64 [L, (N-1)*H] or None.
        n_heads: H.
        pad_id: compressed pad id.
        blocked: optional bool [B, T] (see `shifted_history`).

    Returns:
        int64 [B, T, L, (N-1)*H].
    """
    history = shifted_history(compressed, multipliers.shape[-1], pad_id, blocked)
    mixes = ngram_mixes(history, multipliers)
    per_column = mixes.repeat_interleave(n_heads, dim=-1)
    buckets = torch.remainder(per_column, primes)
    return buckets if offsets is None else buckets + offsets


def hash_decode_reference(
    history: torch.Tensor,
    slots: torch.Tensor,
    compressed: torch.Tensor,
    *,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor | None,
    n_heads: int,
    pad_id: int,
    valid: torch.Tensor | None = None,
    blocked: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step in plain torch: hash [B] new tokens against `history`, update it in place.

    Args:
        history: int64 [n_slots, N-1] (`NgramHistory.ids`).
        slots: [B] slot per row; outside [0, n_slots) marks a padding row.
        compressed: [B] compressed ids of the new tokens.
        valid: optional bool [B]; False marks a padding row.
        blocked: optional bool [B]; the new token is hidden from later look-backs.
        multipliers, primes, offsets, n_heads, pad_id: as in `hash_reference`.

    Returns:
        int64 [B, L, (N-1)*H]; padding rows hold bucket 0 (+ offset) of every column.
        Live rows must name distinct slots.
    """
    n_slots = history.shape[0]
    slots = slots.to(history.device).long()
    live = (slots >= 0) & (slots < n_slots)
    if valid is not None:
        live = live & valid.to(history.device)
    c = compressed.to(history.device).long()
    pad = torch.full_like(c, pad_id)
    c = torch.where(live, c, pad)
    hist = history[slots.clamp(0, n_slots - 1)].long()
    hist = torch.where(live[:, None], hist, torch.full_like(hist, pad_id))
    window = torch.cat([c[:, None], hist], dim=1)  # [B, N]: distance 0..N-1
    mixes = ngram_mixes(window[:, None, :], multipliers)[:, 0]  # [B, L, N-1]
    buckets = torch.remainder(mixes.repeat_interleave(n_heads, dim=-1), primes)
    buckets = torch.where(live[:, None, None], buckets, torch.zeros_like(buckets))
    row_ids = buckets if offsets is None else buckets + offsets
    new = torch.cat([c[:, None], hist[:, :-1]], dim=1)
    if blocked is not None:
        new = torch.where(blocked.to(history.device)[:, None], torch.full_like(new, pad_id), new)
    history[slots[live]] = new[live].to(history.dtype)
    return row_ids
