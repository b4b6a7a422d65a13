"""Ragged (varlen) hashing in plain torch: the reference the ragged Triton kernels are held to.

A serving engine schedules one flat batch: prefill chunks of long prompts, prompts whose
first tokens a prefix cache already holds, single decode tokens and speculative drafts,
back to back. Sequence b owns tokens ``cu_seqlens[b] : cu_seqlens[b+1]`` of the flat
batch (the usual varlen convention); tokens past ``cu_seqlens[-1]`` are padding (a fixed
token budget under CUDA graphs) and touch nothing.

What a chunk's first tokens look back at comes from a *look-back*: int64 [B, N-1] compressed
ids in history order (column m = the id m+1 positions before the chunk's first token; the
pad where the sequence has nothing there or a block hides it). It is an `NgramHistory`
slot's row (the sequence continues: next prefill chunk, decode token, draft tokens) or is
built from explicit token ids (`lookback_from_ids`: a prompt whose first tokens hit a
prefix cache, a sequence handed over from another process).

* `ragged_windows`: [n, N] compressed ids at distances 0..N-1 of every flat token;
* `hash_ragged_reference`: row ids [n, L, n_cols], equal to hashing each whole sequence;
* `advance_reference`: a history's new rows after each sequence took its first
  ``n_commit[b]`` chunk tokens (all of them for prefill/decode; 1 + accepted drafts for
  speculative verification), what `NgramHistory` holds for the next chunk.
"""

from __future__ import annotations

import torch

from condmem.ops.hash.reference import ngram_mixes


def token_sequences(cu_seqlens: torch.Tensor, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence index, index within the sequence, live) of every flat token; padding tokens
    (at or past ``cu_seqlens[-1]``) get sequence 0, index 0 and live False."""
    cu = cu_seqlens.long()
    flat = torch.arange(n_tokens, device=cu.device)
    seq = torch.searchsorted(cu[1:], flat, right=True).clamp(max=max(cu.numel() - 2, 0))
    live = flat < cu[-1]
    seq = torch.where(live, seq, torch.zeros_like(seq))
    local = torch.where(live, flat - cu[seq], torch.zeros_like(flat))
    return seq, local, live


def ragged_windows(
    compressed: torch.Tensor,
    cu_seqlens: torch.Tensor,
    lookback: torch.Tensor,
    max_ngram_size: int,
    pad_id: int,
    blocked: torch.Tensor | None = None,
) -> torch.Tensor:
    """[n] compressed ids -> [n, N]: column k is the id k positions back (pad where hidden).

    A look-back that reaches a blocked position of the chunk, or passes one, reads the pad;
    the look-back tensor's own pads stand for what the sequence hid before the chunk.
    """
    n = compressed.numel()
    seq, local, live = token_sequences(cu_seqlens, n)
    c = torch.where(live, compressed.long(), torch.full_like(compressed.long(), pad_id))
    columns = [c]
    dead = torch.zeros(n, dtype=torch.bool, device=c.device)
    flat = torch.arange(n, device=c.device)
    for k in range(1, max_ngram_size):
        inside = local >= k
        src = (flat - k).clamp(min=0)
        if blocked is not None:
            dead = dead | (inside & blocked[src])
        from_chunk = c[src]
        from_lookback = lookback[seq, (k - local - 1).clamp(0, max_ngram_size - 2)].long()
        value = torch.where(inside, from_chunk, from_lookback)
        columns.append(torch.where(dead | ~live, torch.full_like(value, pad_id), value))
    return torch.stack(columns, dim=-1)


def hash_ragged_reference(
    compressed: torch.Tensor,
    cu_seqlens: torch.Tensor,
    lookback: torch.Tensor,
    *,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor | None,
    n_heads: int,
    pad_id: int,
    blocked: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row ids (bucket ids when `offsets` is None) [n, L, (N-1)*H]; padding tokens hold bucket 0."""
    windows = ragged_windows(compressed, cu_seqlens, lookback, multipliers.shape[-1], pad_id, blocked)
    mixes = ngram_mixes(windows[None], multipliers)[0]
    buckets = torch.remainder(mixes.repeat_interleave(n_heads, dim=-1), primes)
    _, _, live = token_sequences(cu_seqlens, compressed.numel())
    buckets = torch.where(live[:, None, None], buckets, torch.zeros_like(buckets))
    return buckets if offsets is None else buckets + offsets


def advance_reference(
    history: torch.Tensor,
    slots: torch.Tensor,
    compressed: torch.Tensor,
    cu_seqlens: torch.Tensor,
    n_commit: torch.Tensor | None,
    pad_id: int,
    blocked: torch.Tensor | None = None,
) -> None:
    """Advance each sequence's history row by its first ``n_commit[b]`` chunk tokens (in place).

    Rows of sequences whose slot is outside [0, n_slots) are left alone. ``n_commit`` None:
    every chunk token; values are clamped to [0, chunk length].
    """
    n_slots, depth = history.shape
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    take = lengths if n_commit is None else torch.minimum(n_commit.long().clamp(min=0), lengths)
    slots = slots.long()
    live = (slots >= 0) & (slots < n_slots)
    if not bool(live.any()):
        return
    old = history[slots.clamp(0, n_slots - 1)].long()  # [B, depth]
    c = compressed.long()
    m = torch.arange(depth, device=c.device)
    pos = take[:, None] - 1 - m[None, :]  # chunk position of column m
    in_chunk = pos >= 0
    src = (cu[:-1, None] + pos.clamp(min=0)).clamp(max=max(c.numel() - 1, 0))
    from_chunk = c[src] if c.numel() else torch.full_like(pos, pad_id)
    from_old = old.gather(1, (-pos - 1).clamp(0, depth - 1))
    value = torch.where(in_chunk, from_chunk, from_old)
    if blocked is not None and c.numel():
        # Column m is hidden when any taken position from pos_m to the chunk's last taken one is blocked.
        b = blocked[src] & in_chunk
        hidden = torch.cumsum(b.to(torch.int32), dim=1) > 0
        value = torch.where(hidden, torch.full_like(value, pad_id), value)
    history[slots[live]] = value[live].to(history.dtype)


def lookback_from_ids(lookback_ids: torch.Tensor, lookup: torch.Tensor | None, pad_id: int) -> torch.Tensor:
    """Explicit look-back token ids [B, N-1], oldest first, -1 where the sequence has nothing,
    -> compressed look-back in history order (column m = m+1 positions back)."""
    ids = lookback_ids.long().flip(1)
    known = ids >= 0
    if lookup is not None:
        compressed = lookup[ids.clamp(0, lookup.numel() - 1)]
    else:
        compressed = ids
    # Nothing older than an unknown position is known either.
    known = torch.cumprod(known.to(torch.int64), dim=1).bool()
    return torch.where(known, compressed, torch.full_like(compressed, pad_id))
