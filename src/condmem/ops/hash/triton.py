"""Triton kernels of the n-gram hash: prefill (a whole batch) and decode (one token per sequence).

Both compute exactly what `condmem.ops.hash.reference` computes (and are tested with
``torch.equal`` against it):

* **prefill**: token ids [B, T] (+ optional blocked mask) -> row ids [B, T, L, n_cols]
  for every Engram layer in one launch. A program owns ``BLOCK_T`` consecutive
  positions of the flattened batch and all layers; the look-back loop runs over the
  distances k = 1..N-1, carrying every layer's running mix in one [BLOCK_T, L] tile and
  writing the H columns of order k+1 as soon as that order's mix is known.
* **ragged**: a flat batch of sequences (``cu_seqlens``) whose chunks look back into
  their `NgramHistory` slot or an explicit look-back (chunked prefill, prefix-cache hits,
  decode tokens and speculative drafts in one launch); **advance** then writes each
  sequence's new history (a second, tiny launch: a program cannot know that another
  program of the same launch has finished reading the row it would overwrite).
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

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from condmem.ops.launch import FastLaunch
from condmem.ops.triton_util import cdiv, next_pow2


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
def _write_id_range(ids_ptr, idx, mask, range_ptr, pid, bad_bounds):
    """This program's [max id, max -id, broken boundaries] over `mask`, at ``range_ptr[pid]``.

    One slot per program (no atomics, so the buffer needs no zeroing launch); the host
    reduces the slots when it checks them.
    """
    raw = tl.load(ids_ptr + idx, mask=mask, other=0).to(tl.int64)
    raw = tl.minimum(tl.maximum(raw, -2147483647), 2147483647).to(tl.int32)
    tl.store(range_ptr + pid * 3, tl.max(tl.where(mask, raw, 0), axis=0))
    tl.store(range_ptr + pid * 3 + 1, tl.max(tl.where(mask, -raw, 0), axis=0))
    tl.store(range_ptr + pid * 3 + 2, tl.full([], 0, tl.int32) + bad_bounds)


@triton.jit
def _fold(mix, ck, mult_at, lmask):
    """Token t-k (`ck`) folded into every layer's running `mix` [T, L] with the layers' multipliers
    of distance k (at `mult_at`); returns the new mix."""
    mk = tl.load(mult_at, mask=lmask, other=0)
    return mix ^ (ck[:, None] * mk[None, :])


@triton.jit
def _store_buckets(
    mix,
    live,
    col,
    cmask,
    omask,
    out_row,
    prime_ptr,
    magic_ptr,
    offset_ptr,
    WITH_OFFSETS: tl.constexpr,
    FAST_MOD: tl.constexpr,
):
    """One n-gram order of every token and layer: reduce each layer's `mix` by the prime of each
    head's column `col` [L, H] into its bucket (0 for tokens that are not `live`) and store the
    buckets (+ the layer's row offsets) in their columns."""
    p = tl.load(prime_ptr + col, mask=cmask, other=2)
    magic = tl.load(magic_ptr + col, mask=cmask, other=0)
    bucket = _mod(mix[:, :, None], p[None, :, :], magic[None, :, :], FAST_MOD)
    bucket = tl.where(live[:, None, None], bucket, 0)
    if WITH_OFFSETS:
        bucket += tl.load(offset_ptr + col, mask=cmask, other=0)[None, :, :]
    tl.store(out_row[:, None, None] + col[None, :, :], bucket, mask=omask)


@triton.jit
def _hash_prefill_kernel(
    ids_ptr,
    lookup_ptr,
    blocked_ptr,
    mult_ptr,
    prime_ptr,
    magic_ptr,
    offset_ptr,
    out_ptr,
    range_ptr,
    n_tokens,
    seq_len,
    vocab,
    n_layers,
    max_n,
    n_heads,
    pad_id,
    BLOCK_T: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_LOOKUP: tl.constexpr,
    HAS_BLOCKED: tl.constexpr,
    WITH_OFFSETS: tl.constexpr,
    FAST_MOD: tl.constexpr,
    CHECK: tl.constexpr,
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

    if CHECK:
        _write_id_range(ids_ptr, tok, tmask, range_ptr, pid, 0)
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
        mix = _fold(mix, ck, mult_ptr + lay * max_n + k, lmask)
        col = lay[:, None] * n_cols + (k - 1) * n_heads + head[None, :]  # [L, H] column index
        _store_buckets(mix, tmask, col, cmask, omask, out_row, prime_ptr, magic_ptr, offset_ptr, WITH_OFFSETS, FAST_MOD)


@triton.jit
def _hash_decode_kernel(
    ids_ptr,
    lookup_ptr,
    slot_ptr,
    valid_ptr,
    blocked_ptr,
    hist_ptr,
    mult_ptr,
    prime_ptr,
    magic_ptr,
    offset_ptr,
    out_ptr,
    n_rows,
    n_slots,
    vocab,
    n_layers,
    max_n,
    n_heads,
    pad_id,
    BLOCK_B: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_LOOKUP: tl.constexpr,
    HAS_VALID: tl.constexpr,
    HAS_BLOCKED: tl.constexpr,
    WITH_OFFSETS: tl.constexpr,
    FAST_MOD: tl.constexpr,
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
        mix = _fold(mix, ck, mult_ptr + lay * max_n + k, lmask)
        col = lay[:, None] * n_cols + (k - 1) * n_heads + head[None, :]  # [L, H] column index
        _store_buckets(mix, live, col, cmask, omask, out_row, prime_ptr, magic_ptr, offset_ptr, WITH_OFFSETS, FAST_MOD)
    # Every thread's history reads above happen before any thread's write below.
    tl.debug_barrier()
    tl.store(hist_at, new_hist.to(hist_ptr.dtype.element_ty), mask=hmask2)


_PREFILL = FastLaunch(_hash_prefill_kernel)
_DECODE = FastLaunch(_hash_decode_kernel)


def id_range_rows(n_tokens: int, block_t: int = 128) -> int:
    """Programs of a hash launch over `n_tokens`: the rows of ranges it writes (`id_range`)."""
    return max(1, cdiv(n_tokens, block_t))


def id_range_slots(n_tokens: int, device, block_t: int = 128) -> torch.Tensor:
    """Uninitialized int32 [programs, 3] for the kernels' per-program id ranges."""
    return torch.empty((id_range_rows(n_tokens, block_t), 3), dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=64)
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
    id_range: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row ids (bucket ids when `offsets` is None) of every position, one launch.

    Args:
        ids: [B, T] token ids (compressed ids when `lookup` is None), any integer dtype.
        multipliers: int64 [L, N]; primes, magic (`barrett_magic`), offsets: int64 [L, (N-1)*H].
        n_heads: H.
        pad_id: compressed pad id.
        lookup: optional int64 [vocab] token id -> compressed id, applied in the kernel.
        blocked: optional bool [B, T] (see `condmem.ops.hash.reference.shifted_history`).
        fast_mod: Barrett reduction instead of the 64-bit ``%``.
        out: optional int64 [B, T, L, (N-1)*H] to write into.
        id_range: optional int32 [programs, 3] (`id_range_slots`, or page-locked host memory as a
            `condmem.ops.launch.HostPointer`): each program writes its ``[max id, max -id, 0]``
            there (no host sync, no zeroing).

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
    grid = (cdiv(n_tokens, block_t),)
    block_l, block_h = _tile_sizes(n_layers, n_heads)
    _PREFILL(
        grid,
        (
            ids,
            lookup if lookup is not None else ids,
            blocked_b if blocked_b is not None else ids,
            multipliers,
            primes,
            magic,
            offsets if offsets is not None else primes,
            out,
            id_range if id_range is not None else ids,
        ),
        (n_tokens, length, 0 if lookup is None else lookup.numel(), n_layers, max_n, n_heads, pad_id),
        (),
        num_warps,
        BLOCK_T=block_t,
        BLOCK_L=block_l,
        BLOCK_H=block_h,
        HAS_LOOKUP=lookup is not None,
        HAS_BLOCKED=blocked is not None,
        WITH_OFFSETS=offsets is not None,
        FAST_MOD=fast_mod,
        CHECK=id_range is not None,
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
    grid = (cdiv(batch, block_b),)
    block_l, block_h = _tile_sizes(n_layers, n_heads)
    _DECODE(
        grid,
        (
            ids.contiguous(),
            lookup if lookup is not None else ids,
            slots.contiguous(),
            valid_b if valid_b is not None else slots,
            blocked_b if blocked_b is not None else slots,
            history,
            multipliers,
            primes,
            magic,
            offsets if offsets is not None else primes,
            out,
        ),
        (
            batch,
            history.shape[0],
            0 if lookup is None else lookup.numel(),
            n_layers,
            max_n,
            n_heads,
            pad_id,
        ),
        (),
        4,
        BLOCK_B=block_b,
        BLOCK_L=block_l,
        BLOCK_H=block_h,
        BLOCK_K=max(4, next_pow2(max_n - 1)),  # (narrower tiles crash Triton 3.6)
        HAS_LOOKUP=lookup is not None,
        HAS_VALID=valid is not None,
        HAS_BLOCKED=blocked is not None,
        WITH_OFFSETS=offsets is not None,
        FAST_MOD=fast_mod,
    )
    return out


# ---------------------------------------------------------------------------- ragged (varlen) batches


@triton.jit
def _sequence_of(cu_ptr, tok, live, n_live, n_seqs, BLOCK_T: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """Each token's sequence: the largest b < n_seqs with cu[b] <= tok (skips empty sequences)."""
    lo = tl.zeros([BLOCK_T], dtype=tl.int64)
    hi = tl.zeros([BLOCK_T], dtype=tl.int64) + (n_seqs - 1)
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        go = tl.load(cu_ptr + mid, mask=live & (mid <= hi), other=n_live + 1).to(tl.int64) <= tok
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    return lo


@triton.jit
def _broken_boundaries(cu_ptr, pid, n_live, n_tokens, n_seqs, BLOCK_T: tl.constexpr):
    """Program 0's check of the boundaries at `cu_ptr` (start at 0, never decrease, end within the
    batch): 1 if broken, else 0. The other programs return 0."""
    bad_bounds = (pid < 0).to(tl.int32)
    if pid == 0:
        first = tl.load(cu_ptr).to(tl.int64)
        bad_bounds = ((first != 0) | (n_live > n_tokens)).to(tl.int32)
        for s0 in range(0, n_seqs, BLOCK_T):
            i = s0 + tl.arange(0, BLOCK_T)
            im = i < n_seqs
            a = tl.load(cu_ptr + i, mask=im, other=0).to(tl.int64)
            b = tl.load(cu_ptr + i + 1, mask=im, other=0).to(tl.int64)
            bad_bounds = bad_bounds | tl.max((b < a).to(tl.int32), axis=0)
    return bad_bounds


@triton.jit
def _token_before_chunk(
    hist_ptr,
    lb_ptr,
    slot,
    seq,
    back,
    live,
    inside,
    has_hist,
    depth,
    pad_id,
    BLOCK_T: tl.constexpr,
    HAS_LOOKBACK: tl.constexpr,
):
    """The compressed token `back` + 1 places before each chunk's start, for the live tokens whose
    look-back leaves the chunk (not `inside`): the slot's history, else the explicit look-back,
    else the pad. (Clamped so that broken boundaries, reported by the check, never read out of bounds.)"""
    j = tl.minimum(tl.maximum(back, 0), depth - 1)
    before = live & ~inside
    from_hist = tl.load(hist_ptr + slot * depth + j, mask=before & has_hist, other=pad_id).to(tl.int64)
    lb = tl.full([BLOCK_T], pad_id, tl.int64)
    if HAS_LOOKBACK:
        lb = tl.load(lb_ptr + seq * depth + j, mask=before & ~has_hist, other=pad_id).to(tl.int64)
    return tl.where(has_hist, from_hist, lb)


@triton.jit
def _hash_ragged_kernel(
    ids_ptr,
    lookup_ptr,
    blocked_ptr,
    cu_ptr,
    slot_ptr,
    hist_ptr,
    lb_ptr,
    mult_ptr,
    prime_ptr,
    magic_ptr,
    offset_ptr,
    out_ptr,
    range_ptr,
    n_tokens,
    n_seqs,
    n_slots,
    vocab,
    n_layers,
    max_n,
    n_heads,
    pad_id,
    BLOCK_T: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    HAS_LOOKUP: tl.constexpr,
    HAS_BLOCKED: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    HAS_LOOKBACK: tl.constexpr,
    WITH_OFFSETS: tl.constexpr,
    FAST_MOD: tl.constexpr,
    CHECK: tl.constexpr,
):
    pid = tl.program_id(0)
    tok = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    n_live = tl.load(cu_ptr + n_seqs).to(tl.int64)
    tmask = tok < n_tokens
    live = tmask & (tok < n_live)
    seq = _sequence_of(cu_ptr, tok, live, n_live, n_seqs, BLOCK_T, SEARCH_STEPS)
    local = tok - tl.load(cu_ptr + seq, mask=live, other=0).to(tl.int64)
    depth = max_n - 1
    slot = tl.full([BLOCK_T], -1, tl.int64)
    if HAS_SLOTS:
        slot = tl.load(slot_ptr + seq, mask=live, other=-1).to(tl.int64)
    has_hist = live & (slot >= 0) & (slot < n_slots)

    lay = tl.arange(0, BLOCK_L)
    lmask = lay < n_layers
    head = tl.arange(0, BLOCK_H)
    hmask = head < n_heads
    n_cols = depth * n_heads
    cmask = lmask[:, None] & hmask[None, :]
    omask = tmask[:, None, None] & cmask[None, :, :]
    out_row = out_ptr + tok * (n_layers * n_cols)

    if CHECK:
        bad_bounds = _broken_boundaries(cu_ptr, pid, n_live, n_tokens, n_seqs, BLOCK_T)
        _write_id_range(ids_ptr, tok, live, range_ptr, pid, bad_bounds)

    c = _load_compressed(ids_ptr, lookup_ptr, tok, live, vocab, pad_id, HAS_LOOKUP)
    m0 = tl.load(mult_ptr + lay * max_n, mask=lmask, other=0)
    mix = c[:, None] * m0[None, :]
    dead = tok < 0
    for k in range(1, max_n):
        inside = live & (local >= k)
        ck = _load_compressed(ids_ptr, lookup_ptr, tok - k, inside, vocab, pad_id, HAS_LOOKUP)
        if HAS_BLOCKED:
            b = tl.load(blocked_ptr + tok - k, mask=inside, other=0)
            dead = dead | (b != 0)
        # Before the chunk: the slot's history, else the explicit look-back, else the pad.
        prev = _token_before_chunk(
            hist_ptr, lb_ptr, slot, seq, k - local - 1, live, inside, has_hist, depth, pad_id, BLOCK_T, HAS_LOOKBACK
        )
        ck = tl.where(inside, ck, prev)
        ck = tl.where(dead, pad_id, ck)
        mix = _fold(mix, ck, mult_ptr + lay * max_n + k, lmask)
        col = lay[:, None] * n_cols + (k - 1) * n_heads + head[None, :]  # [L, H] column index
        _store_buckets(mix, live, col, cmask, omask, out_row, prime_ptr, magic_ptr, offset_ptr, WITH_OFFSETS, FAST_MOD)


@triton.jit
def _advance_kernel(
    ids_ptr,
    lookup_ptr,
    blocked_ptr,
    cu_ptr,
    slot_ptr,
    commit_ptr,
    hist_ptr,
    n_tokens,
    n_seqs,
    n_slots,
    vocab,
    depth,
    pad_id,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_LOOKUP: tl.constexpr,
    HAS_BLOCKED: tl.constexpr,
    HAS_COMMIT: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid.to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    bmask = b < n_seqs
    slot = tl.load(slot_ptr + b, mask=bmask, other=-1).to(tl.int64)
    live = bmask & (slot >= 0) & (slot < n_slots)
    start = tl.load(cu_ptr + b, mask=live, other=0).to(tl.int64)
    length = tl.load(cu_ptr + b + 1, mask=live, other=0).to(tl.int64) - start
    take = tl.maximum(length, 0)
    if HAS_COMMIT:
        take = tl.minimum(tl.maximum(tl.load(commit_ptr + b, mask=live, other=0).to(tl.int64), 0), take)
    kk = tl.arange(0, BLOCK_K)
    kmask = live[:, None] & (kk[None, :] < depth)
    pos = take[:, None] - 1 - kk[None, :]  # chunk position that column kk reads
    in_chunk = pos >= 0
    src = start[:, None] + pos
    in_chunk = in_chunk & (src >= 0) & (src < n_tokens)
    from_chunk = _load_compressed(ids_ptr, lookup_ptr, src, kmask & in_chunk, vocab, pad_id, HAS_LOOKUP)
    row = hist_ptr + slot[:, None] * depth
    old_col = tl.minimum(tl.maximum(kk[None, :] - take[:, None], 0), depth - 1)
    from_old = tl.load(row + old_col, mask=kmask & ~in_chunk, other=pad_id).to(tl.int64)
    value = tl.where(in_chunk, from_chunk, from_old)
    if HAS_BLOCKED:
        bl = tl.load(blocked_ptr + src, mask=kmask & in_chunk, other=0).to(tl.int32)
        value = tl.where(tl.cumsum(bl, axis=1) > 0, pad_id, value)
    # Each slot belongs to one row of one program: its reads above precede its write below.
    tl.debug_barrier()
    tl.store(row + kk[None, :], value.to(hist_ptr.dtype.element_ty), mask=kmask)


_RAGGED = FastLaunch(_hash_ragged_kernel)
_ADVANCE = FastLaunch(_advance_kernel)


def hash_ragged_triton(
    ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    magic: torch.Tensor,
    offsets: torch.Tensor | None,
    n_heads: int,
    pad_id: int,
    lookup: torch.Tensor | None = None,
    blocked: torch.Tensor | None = None,
    history: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    lookback: torch.Tensor | None = None,
    id_range: torch.Tensor | None = None,
    fast_mod: bool = True,
    block_t: int = 128,
    num_warps: int = 4,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row ids of a flat batch of sequences, one launch (reads `history`, never writes it).

    Args:
        ids: [n] token ids (compressed when `lookup` is None); tokens past ``cu_seqlens[-1]``
            are padding: bucket 0 (+ offset), no history read.
        cu_seqlens: [B+1] int32/int64 sequence boundaries (``cu_seqlens[0] == 0``, non-decreasing).
        history, slots: optional `NgramHistory.ids` and [B] slot per sequence (outside
            [0, n_slots): no history) for what each chunk's first tokens look back at.
        lookback: optional int64 [B, N-1] compressed look-back in history order, for
            sequences without a history slot.
        id_range: optional int32 [programs, 3] (`id_range_slots`): each program writes
            ``[max id, max -id, broken boundaries]`` of its live tokens (program 0 checks
            `cu_seqlens`); read later, without a sync here.
        (other arguments as in `hash_prefill_triton`)

    Returns:
        int64 [n, L, (N-1)*H], equal (``torch.equal``) to `hash_ragged_reference`.
    """
    (n_tokens,) = ids.shape
    n_seqs = cu_seqlens.numel() - 1
    n_layers, max_n = multipliers.shape
    n_cols = primes.shape[-1]
    if out is None:
        out = torch.empty((n_tokens, n_layers, n_cols), dtype=torch.int64, device=ids.device)
    if n_tokens == 0:
        return out
    if n_seqs < 1:
        raise ValueError("cu_seqlens must hold at least [0, n]")
    _launch_hash_ragged(
        ids.contiguous(),
        cu_seqlens.contiguous(),
        out,
        tables=(multipliers, primes, magic, offsets),
        n_heads=n_heads,
        pad_id=pad_id,
        lookup=lookup,
        blocked=blocked,
        history=history,
        slots=slots,
        lookback=lookback,
        id_range=id_range,
        fast_mod=fast_mod,
        block_t=block_t,
        num_warps=num_warps,
    )
    return out


def _launch_hash_ragged(
    ids,
    cu,
    out,
    *,
    tables,
    n_heads,
    pad_id,
    lookup,
    blocked,
    history,
    slots,
    lookback,
    id_range,
    fast_mod,
    block_t,
    num_warps,
) -> None:
    """`_hash_ragged_kernel` over contiguous `ids` and `cu` into `out` (the arguments of `hash_ragged_triton`;
    `tables`: its multipliers, primes, magic and offsets)."""
    multipliers, primes, magic, offsets = tables
    (n_tokens,) = ids.shape
    n_seqs = cu.numel() - 1
    n_layers, max_n = multipliers.shape
    blocked_b = _as_bytes(blocked)
    grid = (cdiv(n_tokens, block_t),)
    block_l, block_h = _tile_sizes(n_layers, n_heads)
    # Enough halvings to search B sequences; rounded up so few variants compile.
    steps = max(4, -(-max(n_seqs, 1).bit_length() // 4) * 4)
    has_slots = history is not None and slots is not None
    _RAGGED(
        grid,
        (
            ids,
            lookup if lookup is not None else ids,
            blocked_b if blocked_b is not None else ids,
            cu,
            slots.contiguous() if has_slots else cu,
            history if has_slots else ids,
            lookback.contiguous() if lookback is not None else ids,
            multipliers,
            primes,
            magic,
            offsets if offsets is not None else primes,
            out,
            id_range if id_range is not None else cu,
        ),
        (
            n_tokens,
            n_seqs,
            history.shape[0] if has_slots else 0,
            0 if lookup is None else lookup.numel(),
            n_layers,
            max_n,
            n_heads,
            pad_id,
        ),
        (),
        num_warps,
        BLOCK_T=block_t,
        BLOCK_L=block_l,
        BLOCK_H=block_h,
        SEARCH_STEPS=steps,
        HAS_LOOKUP=lookup is not None,
        HAS_BLOCKED=blocked is not None,
        HAS_SLOTS=has_slots,
        HAS_LOOKBACK=lookback is not None,
        WITH_OFFSETS=offsets is not None,
        FAST_MOD=fast_mod,
        CHECK=id_range is not None,
    )


def advance_triton(
    history: torch.Tensor,
    slots: torch.Tensor,
    ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    pad_id: int,
    lookup: torch.Tensor | None = None,
    blocked: torch.Tensor | None = None,
    n_commit: torch.Tensor | None = None,
    block_b: int = 32,
) -> None:
    """Advance each sequence's history row by its first ``n_commit[b]`` chunk tokens (all when
    None), in place; equal to `condmem.ops.hash.ragged_reference.advance_reference`. Slots must be distinct."""
    n_seqs = cu_seqlens.numel() - 1
    if n_seqs < 1:
        return
    depth = history.shape[1]
    blocked_b = _as_bytes(blocked)
    _ADVANCE(
        (cdiv(n_seqs, block_b),),
        (
            ids.contiguous(),
            lookup if lookup is not None else ids,
            blocked_b if blocked_b is not None else ids,
            cu_seqlens.contiguous(),
            slots.contiguous(),
            n_commit.contiguous() if n_commit is not None else slots,
            history,
        ),
        (ids.numel(), n_seqs, history.shape[0], 0 if lookup is None else lookup.numel(), depth, pad_id),
        (),
        4,
        BLOCK_B=block_b,
        BLOCK_K=max(4, next_pow2(depth)),
        HAS_LOOKUP=lookup is not None,
        HAS_BLOCKED=blocked is not None,
        HAS_COMMIT=n_commit is not None,
    )
