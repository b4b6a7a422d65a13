"""Triton kernels of the n-gram hash: prefill (a whole batch) and decode (one token per sequence).

Both compute exactly what `condmem.hashing.reference` computes (and are tested with
``torch.equal`` against it):

* **prefill**: token ids [B, T] (+ optional blocked mask) -> row ids [B, T, L, n_cols]
  for every Engram layer in one launch. A program owns ``BLOCK_T`` consecutive
  positions of the flattened batch and all layers; the look-back loop runs over the
  distances k = 1..N-1, carrying every layer's running mix in one [BLOCK_T, L] tile and
  writing the H columns of order k+1 as soon as that order's mix is known.
* **decode**: one new token per row, its N-1 predecessors read from `NgramHistory`
  (slot per sequence); the same launch writes the updated history. Padding rows
  (slot outside [0, n_slots) or ``valid`` False) read and write no history and get
  bucket 0 of every column (in-range rows, so a downstream gather stays in bounds).

Optionally the compression map (token id -> compressed id) is applied in the kernel.

Modulo. Every mix is a non-negative int64 below 2**63 (the multipliers are bounded
for that), so the bucket ``mix % p`` is the same in C and Python conventions. With
``fast_mod`` (the default) it is computed by Barrett reduction: ``q = umulhi(mix,
floor((2**64-1)/p))`` is floor(mix/p) or one less (because mix < 2**63), so one
conditional subtraction finishes it. That replaces a 64-bit software division (a few
dozen instructions a column) with one 64-bit multiply-high; ``fast_mod=False`` keeps
the plain ``%`` for comparison.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from condmem.ops.triton_util import next_pow2


def barrett_magic(primes: np.ndarray | torch.Tensor) -> torch.Tensor:
    """floor((2**64 - 1) / p) per prime, as the int64 bit pattern of the uint64 (for `fast_mod`)."""
    p = np.asarray(primes.cpu() if isinstance(primes, torch.Tensor) else primes, dtype=np.int64)
    if p.size and int(p.min()) < 2:
        raise ValueError("Barrett reduction needs primes >= 2")
    magic = np.array([(2**64 - 1) // int(v) for v in p.reshape(-1)], dtype=np.uint64).reshape(p.shape)
    return torch.from_numpy(magic.view(np.int64).copy())


@triton.jit
def _mod(x, p, magic, FAST_MOD: tl.constexpr):
    """x % p for 0 <= x < 2**63 and 2 <= p < 2**63 (int64 in, int64 out)."""
    if FAST_MOD:
        xu = x.to(tl.uint64, bitcast=True)
        pu = p.to(tl.uint64, bitcast=True)
        q = tl.umulhi(xu, magic.to(tl.uint64, bitcast=True))
        r = xu - q * pu
        r = tl.where(r >= pu, r - pu, r)
        return r.to(tl.int64, bitcast=True)
    else:
        return x % p


@triton.jit
def _load_compressed(ids_ptr, lookup_ptr, idx, mask, vocab, pad_id, HAS_LOOKUP: tl.constexpr):
    """Compressed id at flat index `idx`; `pad_id` where `mask` is False.

    Token ids outside the lookup's range read the pad (memory-safe; the hasher's
    range check reports them before a launch when asked to).
    """
    t = tl.load(ids_ptr + idx, mask=mask, other=0).to(tl.int64)
    if HAS_LOOKUP:
        ok = mask & (t >= 0) & (t < vocab)
        t = tl.load(lookup_ptr + t, mask=ok, other=pad_id).to(tl.int64)
    return tl.where(mask, t, pad_id)


@triton.jit
def _hash_prefill_kernel(
    ids_ptr, lookup_ptr, blocked_ptr, mult_ptr, prime_ptr, magic_ptr, offset_ptr, out_ptr,
    n_tokens, seq_len, vocab, n_layers, max_n, n_heads, pad_id,
    BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_LOOKUP: tl.constexpr, HAS_BLOCKED: tl.constexpr, WITH_OFFSETS: tl.constexpr, FAST_MOD: tl.constexpr,
):
    pid = tl.program_id(0)
    tok = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < n_tokens
    pos = tok % seq_len
    lay = tl.arange(0, BLOCK_L)
    lmask = lay < n_layers
    head = tl.arange(0, BLOCK_H)
    hmask = head < n_heads
    n_cols = (max_n - 1) * n_heads
    cmask = lmask[:, None] & hmask[None, :]
    omask = tmask[:, None, None] & cmask[None, :, :]
    out_row = out_ptr + tok * (n_layers * n_cols)

    c = _load_compressed(ids_ptr, lookup_ptr, tok, tmask, vocab, pad_id, HAS_LOOKUP)
    m0 = tl.load(mult_ptr + lay * max_n, mask=lmask, other=0)
    mix = c[:, None] * m0[None, :]  # [T, L]: running mix of every layer
    dead = tok < 0  # all False: no block seen yet
    for k in range(1, max_n):
        back_ok = tmask & (pos >= k)
        ck = _load_compressed(ids_ptr, lookup_ptr, tok - k, back_ok, vocab, pad_id, HAS_LOOKUP)
        if HAS_BLOCKED:
            # A block at distance j hides that position and everything older.
            b = tl.load(blocked_ptr + tok - k, mask=back_ok, other=0)
            dead = dead | (b != 0)
            ck = tl.where(dead, pad_id, ck)
        mk = tl.load(mult_ptr + lay * max_n + k, mask=lmask, other=0)
        mix = mix ^ (ck[:, None] * mk[None, :])
        col = lay[:, None] * n_cols + (k - 1) * n_heads + head[None, :]  # [L, H] column index
        p = tl.load(prime_ptr + col, mask=cmask, other=2)
        magic = tl.load(magic_ptr + col, mask=cmask, other=0)
        bucket = _mod(mix[:, :, None], p[None, :, :], magic[None, :, :], FAST_MOD)
        if WITH_OFFSETS:
            bucket += tl.load(offset_ptr + col, mask=cmask, other=0)[None, :, :]
        tl.store(out_row[:, None, None] + col[None, :, :], bucket, mask=omask)


@triton.jit
def _hash_decode_kernel(
    ids_ptr, lookup_ptr, slot_ptr, valid_ptr, blocked_ptr, hist_ptr,
    mult_ptr, prime_ptr, magic_ptr, offset_ptr, out_ptr,
    n_rows, n_slots, vocab, n_layers, max_n, n_heads, pad_id,
    BLOCK_B: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_LOOKUP: tl.constexpr, HAS_VALID: tl.constexpr, HAS_BLOCKED: tl.constexpr,
    WITH_OFFSETS: tl.constexpr, FAST_MOD: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid.to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = row < n_rows
    slot = tl.load(slot_ptr + row, mask=rmask, other=-1).to(tl.int64)
    live = rmask & (slot >= 0) & (slot < n_slots)
    if HAS_VALID:
        live = live & (tl.load(valid_ptr + row, mask=rmask, other=0) != 0)
    lay = tl.arange(0, BLOCK_L)
    lmask = lay < n_layers
    head = tl.arange(0, BLOCK_H)
    hmask = head < n_heads
    n_cols = (max_n - 1) * n_heads
    depth = max_n - 1
    cmask = lmask[:, None] & hmask[None, :]
    omask = rmask[:, None, None] & cmask[None, :, :]
    out_row = out_ptr + row * (n_layers * n_cols)

    c = _load_compressed(ids_ptr, lookup_ptr, row, live, vocab, pad_id, HAS_LOOKUP)
    # The whole history tile and its shift by one are read before anything is written.
    kk = tl.arange(0, BLOCK_K)
    hist_at = hist_ptr + slot[:, None] * depth + kk[None, :]
    hmask2 = live[:, None] & (kk[None, :] < depth)
    hist = tl.load(hist_at, mask=hmask2, other=pad_id).to(tl.int64)
    shifted = tl.load(hist_at - 1, mask=hmask2 & (kk[None, :] >= 1), other=pad_id).to(tl.int64)
    new_hist = tl.where(kk[None, :] == 0, c[:, None], shifted)
    if HAS_BLOCKED:
        # A blocked new token is hidden from every later look-back, as is all before it.
        nb = tl.load(blocked_ptr + row, mask=rmask, other=0) != 0
        new_hist = tl.where(nb[:, None], pad_id, new_hist)

    m0 = tl.load(mult_ptr + lay * max_n, mask=lmask, other=0)
    mix = c[:, None] * m0[None, :]
    for k in range(1, max_n):
        ck = tl.sum(tl.where(kk[None, :] == k - 1, hist, 0), axis=1)
        mk = tl.load(mult_ptr + lay * max_n + k, mask=lmask, other=0)
        mix = mix ^ (ck[:, None] * mk[None, :])
        col = lay[:, None] * n_cols + (k - 1) * n_heads + head[None, :]
        p = tl.load(prime_ptr + col, mask=cmask, other=2)
        magic = tl.load(magic_ptr + col, mask=cmask, other=0)
        bucket = _mod(mix[:, :, None], p[None, :, :], magic[None, :, :], FAST_MOD)
        bucket = tl.where(live[:, None, None], bucket, 0)
        if WITH_OFFSETS:
            bucket += tl.load(offset_ptr + col, mask=cmask, other=0)[None, :, :]
        tl.store(out_row[:, None, None] + col[None, :, :], bucket, mask=omask)
    # Every thread's history reads above happen before any thread's write below.
    tl.debug_barrier()
    tl.store(hist_at, new_hist.to(hist_ptr.dtype.element_ty), mask=hmask2)


def _tile_sizes(n_layers: int, n_heads: int) -> tuple[int, int]:
    # Floors keep the number of compiled variants small; the idle lanes cost nothing measurable.
    return max(2, next_pow2(n_layers)), max(8, next_pow2(n_heads))


def _as_bytes(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Bool masks travel as uint8 (same storage)."""
    if mask is None:
        return None
    return mask.contiguous().view(torch.uint8)


def hash_prefill_triton(
    ids: torch.Tensor,
    *,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    magic: torch.Tensor,
    offsets: torch.Tensor | None,
    n_heads: int,
    pad_id: int,
    lookup: torch.Tensor | None = None,
    blocked: torch.Tensor | None = None,
    fast_mod: bool = True,
    block_t: int = 128,
    num_warps: int = 4,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row ids (bucket ids when `offsets` is None) of every position, one launch.

    Args:
        ids: [B, T] token ids (compressed ids when `lookup` is None), any integer dtype.
        multipliers: int64 [L, N]; primes, magic (`barrett_magic`), offsets: int64 [L, (N-1)*H].
        n_heads: H.
        pad_id: compressed pad id.
        lookup: optional int64 [vocab] token id -> compressed id, applied in the kernel.
        blocked: optional bool [B, T] (see `condmem.hashing.reference.shifted_history`).
        fast_mod: Barrett reduction instead of the 64-bit ``%``.
        out: optional int64 [B, T, L, (N-1)*H] to write into.

    Returns:
        int64 [B, T, L, (N-1)*H], equal (``torch.equal``) to `hash_reference`.
    """
    batch, length = ids.shape
    n_layers, max_n = multipliers.shape
    n_cols = primes.shape[-1]
    if n_cols != (max_n - 1) * n_heads:
        raise ValueError(f"primes have {n_cols} columns, expected (N-1)*H = {(max_n - 1) * n_heads}")
    if out is None:
        out = torch.empty((batch, length, n_layers, n_cols), dtype=torch.int64, device=ids.device)
    n_tokens = batch * length
    if n_tokens == 0:
        return out
    ids = ids.contiguous()
    blocked_b = _as_bytes(blocked)
    grid = (triton.cdiv(n_tokens, block_t),)
    block_l, block_h = _tile_sizes(n_layers, n_heads)
    _hash_prefill_kernel[grid](
        ids, lookup if lookup is not None else ids, blocked_b if blocked_b is not None else ids,
        multipliers, primes, magic, offsets if offsets is not None else primes, out,
        n_tokens, length, 0 if lookup is None else lookup.numel(), n_layers, max_n, n_heads, pad_id,
        BLOCK_T=block_t, BLOCK_L=block_l, BLOCK_H=block_h,
        HAS_LOOKUP=lookup is not None, HAS_BLOCKED=blocked is not None, WITH_OFFSETS=offsets is not None,
        FAST_MOD=fast_mod, num_warps=num_warps,
    )
    return out


def hash_decode_triton(
    history: torch.Tensor,
    slots: torch.Tensor,
    ids: torch.Tensor,
    *,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    magic: torch.Tensor,
    offsets: torch.Tensor | None,
    n_heads: int,
    pad_id: int,
    lookup: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    blocked: torch.Tensor | None = None,
    fast_mod: bool = True,
    block_b: int = 32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hash one new token per row against its slot's history and update the history in place.

    Args:
        history: [n_slots, N-1] integer tensor (`NgramHistory.ids`), modified in place.
        slots: [B] slot per row; a slot outside [0, n_slots) marks a padding row.
        ids: [B] new token ids (compressed when `lookup` is None).
        valid: optional bool [B]; False marks a padding row (even one naming a live slot).
        blocked: optional bool [B]; the new token is hidden from later look-backs.
        (other arguments as in `hash_prefill_triton`)

    Returns:
        int64 [B, L, (N-1)*H]; padding rows hold bucket 0 (+ offset) of every column.
    """
    (batch,) = slots.shape
    n_layers, max_n = multipliers.shape
    n_cols = primes.shape[-1]
    if out is None:
        out = torch.empty((batch, n_layers, n_cols), dtype=torch.int64, device=ids.device)
    if batch == 0:
        return out
    valid_b, blocked_b = _as_bytes(valid), _as_bytes(blocked)
    grid = (triton.cdiv(batch, block_b),)
    block_l, block_h = _tile_sizes(n_layers, n_heads)
    _hash_decode_kernel[grid](
        ids.contiguous(), lookup if lookup is not None else ids, slots.contiguous(),
        valid_b if valid_b is not None else slots, blocked_b if blocked_b is not None else slots, history,
        multipliers, primes, magic, offsets if offsets is not None else primes, out,
        batch, history.shape[0], 0 if lookup is None else lookup.numel(), n_layers, max_n, n_heads, pad_id,
        BLOCK_B=block_b, BLOCK_L=block_l, BLOCK_H=block_h, BLOCK_K=max(4, next_pow2(max_n - 1)),  # (narrower tiles crash Triton 3.6)
        HAS_LOOKUP=lookup is not None, HAS_VALID=valid is not None, HAS_BLOCKED=blocked is not None,
        WITH_OFFSETS=offsets is not None, FAST_MOD=fast_mod, num_warps=4,
    )
    return out
