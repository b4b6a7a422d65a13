"""Triton kernels of the paged attention ops: split-KV decode, varlen causal prefill, RoPE + cache store.

All three read or write the paged KV cache (``[n_blocks, block_size, n_kv_heads, head_dim]``
per layer) through a block table, and read each sequence's own length from a device
tensor, so a decode step has fixed shapes and is captured in a CUDA graph as is.

* Decode (flash-decoding): one program per (sequence, KV head, split of the positions);
  the H/KV query heads that share a KV head are the rows of one ``tl.dot``, so each cached
  key is read once. Programs whose split lies past the sequence's length exit at once, so
  a step reads the live keys only. Partial (max, sum, unnormalized output) per split are
  combined by a second small kernel; a sequence whose keys fit one split has its output
  written by that split (the combine skips it).
* Prefill: flash attention over packed chunks (``cu_seqlens``); chunk b's query j sits at
  position ``starts[b] + j`` and sees keys 0..``starts[b] + j`` (a chunk after a cached
  prefix, or a whole prompt with ``starts = 0``).
* RoPE + store: rotates q and k by each token's position and writes k, v into its cache
  slot (rows marked invalid write nothing): one launch instead of a dozen elementwise ones.

Softmax runs in base 2 (scores pre-multiplied by log2(e)/sqrt(D)), accumulation in fp32;
fp32 inputs use IEEE dot products (no TF32), so the fp32 reference holds them tightly.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from condmem.ops.triton_util import interpreting, next_pow2

LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(q, k, v, valid, m, l, acc, scale_log2, IEEE: tl.constexpr):
    """One block of keys into a running softmax: scores of q [M, D] against k [N, D] where
    `valid` [M, N] (else -inf), then the running max `m`, sum `l` and unnormalized output
    `acc` [M, D] rescaled and updated with v [N, D]. Returns the new (m, l, acc)."""
    if IEEE:
        sc = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        sc = tl.dot(q, tl.trans(k))
    sc = tl.where(valid, sc * scale_log2, float("-inf"))
    m_new = tl.maximum(m, tl.max(sc, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(sc - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l, acc * alpha[:, None] + pv


@triton.jit
def _rotate(x, partner, c, s, lower):
    """RoPE of a full-width row: ``x * c - partner * s`` in the lower half, ``partner * s + x * c``
    in the upper (`partner`: the other half's element), as `_rope_store_kernel` computes it."""
    return tl.where(lower, x * c - partner * s, partner * s + x * c)


@triton.jit
def _decode_split_kernel(
    Q,
    K,
    V,
    BT,
    LENS,
    O,
    PO,
    PML,
    sq_b,
    sq_h,
    sk_blk,
    sk_pos,
    sk_h,
    sbt_b,
    so_b,
    so_h,
    split_len,
    n_splits,
    n_heads,
    scale_log2,
    KN,
    VN,
    COS,
    SIN,
    skn_b,
    skn_h,
    svn_b,
    svn_h,
    scos,
    REP: tl.constexpr,
    REP_P: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    IEEE: tl.constexpr,
    OFF64: tl.constexpr,
    ROPE: tl.constexpr,
):
    # Over 80 lines: 39 arguments; the key loop and epilogue stay inline (helpers there change ptxas's schedule).
    # Pool offsets in int32 unless the pool has 2**31+ elements (OFF64): [BLOCK_N, D] tile addressing costs time.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    length = tl.load(LENS + b).to(tl.int32)
    # Only splits that hold keys run (split 0 of an empty sequence writes zeros); one split: it writes the output.
    limit = tl.maximum(tl.cdiv(length, split_len), 1)
    if s < limit:
        start = s * split_len
        end = tl.minimum(start + split_len, length)
        r = tl.arange(0, REP_P)
        d = tl.arange(0, DP)
        dm = d < D
        heads = kvh * REP + r
        rmask = r < REP
        b64 = b.to(tl.int64)
        qmask = rmask[:, None] & dm[None, :]
        q = tl.load(Q + b64 * sq_b + heads[:, None] * sq_h + d[None, :], mask=qmask, other=0.0)
        if ROPE:
            # The new token sits at position length - 1: rotate the query here; the split that holds that position
            # rotates the token's key and stores key and value in the cache before reading keys (one launch, not two).
            c, sn, lower, partner, at = _rope_factors(COS, SIN, scos, length, d, dm, D)
            qp = tl.load(Q + b64 * sq_b + heads[:, None] * sq_h + partner[None, :], mask=qmask, other=0.0)
            q = _rotate(q.to(tl.float32), qp.to(tl.float32), c[None, :], sn[None, :], lower[None, :]).to(
                Q.dtype.element_ty
            )
            if (length > 0) & (s == limit - 1):
                kn_row = KN + b64 * skn_b + kvh * skn_h
                dest = _store_new_key(
                    K, kn_row, BT, b64, sbt_b, at, kvh, d, dm, partner, c, sn, lower, sk_blk, sk_pos, sk_h, BS
                )
                _copy_new_value(V + dest, VN + b64 * svn_b + kvh * svn_h + d, dm)
            tl.debug_barrier()  # the stores above are read back by this program's key loop
        m = tl.full([REP_P], float("-inf"), tl.float32)
        l = tl.zeros([REP_P], tl.float32)
        acc = tl.zeros([REP_P, DP], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pm = pos < end
            blk = tl.load(BT + b64 * sbt_b + pos // BS, mask=pm, other=0)
            if OFF64:
                blk = blk.to(tl.int64)
            off = blk * sk_blk + (pos % BS) * sk_pos + kvh * sk_h
            k = tl.load(K + off[:, None] + d[None, :], mask=pm[:, None] & dm[None, :], other=0.0)
            v = tl.load(V + off[:, None] + d[None, :], mask=pm[:, None] & dm[None, :], other=0.0)
            m, l, acc = _online_softmax_step(q, k, v, pm[None, :], m, l, acc, scale_log2, IEEE)
        if DIRECT:
            _store_normalized(O, acc, l, b64 * so_b + heads[:, None] * so_h + d[None, :], rmask[:, None] & dm[None, :])
        elif limit == 1:
            _store_normalized(O, acc, l, b64 * so_b + heads[:, None] * so_h + d[None, :], rmask[:, None] & dm[None, :])
        else:
            base = (b64 * n_heads + heads) * n_splits + s
            tl.store(PO + base[:, None] * D + d[None, :], acc, mask=rmask[:, None] & dm[None, :])
            tl.store(PML + base * 2, m, mask=rmask)
            tl.store(PML + base * 2 + 1, l, mask=rmask)


@triton.jit
def _rope_factors(COS, SIN, scos, length, d, dm, D: tl.constexpr):
    """RoPE of the new token's position `at` = length - 1 (cos and sin tables of row stride `scos`):
    per lane of the head dimension its cos and sin, whether it is in the lower half, and its
    partner lane in the other half. Returns (c, sn, lower, partner, at)."""
    half = D // 2
    lower = d < half
    partner = tl.where(lower, d + half, d - half)
    at = tl.maximum(length - 1, 0)
    c = tl.load(COS + at * scos + d % half, mask=dm, other=0.0)
    sn = tl.load(SIN + at * scos + d % half, mask=dm, other=0.0)
    return c, sn, lower, partner, at


@triton.jit
def _store_new_key(
    K, kn_row, BT, b64, sbt_b, at, kvh, d, dm, partner, c, sn, lower, sk_blk, sk_pos, sk_h, BS: tl.constexpr
):
    """The new token's key (`kn_row`) rotated and stored at position `at` of sequence `b64`'s pages
    (block-table row stride `sbt_b`), KV head `kvh`; returns the offsets it went to in the pool."""
    kn = tl.load(kn_row + d, mask=dm, other=0.0).to(tl.float32)
    knp = tl.load(kn_row + partner, mask=dm, other=0.0).to(tl.float32)
    blk_new = tl.load(BT + b64 * sbt_b + at // BS).to(tl.int64)
    dest = blk_new * sk_blk + (at % BS) * sk_pos + kvh * sk_h + d
    tl.store(K + dest, _rotate(kn, knp, c, sn, lower).to(K.dtype.element_ty), mask=dm)
    return dest


@triton.jit
def _copy_new_value(v_at, vn_at, dm):
    """The new token's value (at `vn_at`) stored at `v_at` in the value pool's dtype."""
    tl.store(v_at, tl.load(vn_at, mask=dm, other=0.0).to(v_at.dtype.element_ty), mask=dm)


@triton.jit
def _store_normalized(O, acc, l, offsets, mask):
    out = acc / tl.maximum(l, 1e-30)[:, None]  # no key (length 0): zeros
    tl.store(O + offsets, out.to(O.dtype.element_ty), mask=mask)


@triton.jit
def _decode_combine_kernel(
    PO, PML, O, LENS, so_b, so_h, split_len, n_splits, n_heads, S_P: tl.constexpr, D: tl.constexpr, DP: tl.constexpr
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    limit = tl.maximum(tl.cdiv(tl.load(LENS + b).to(tl.int32), split_len), 1)
    if limit > 1:
        _combine_row(PO, PML, O, b, h, so_b, so_h, limit, n_splits, n_heads, S_P, D, DP)


@triton.jit
def _combine_row(
    PO, PML, O, b, h, so_b, so_h, limit, n_splits, n_heads, S_P: tl.constexpr, D: tl.constexpr, DP: tl.constexpr
):
    s = tl.arange(0, S_P)
    d = tl.arange(0, DP)
    dm = d < D
    sm = s < limit
    base = (b * n_heads + h) * n_splits + s
    m = tl.load(PML + base * 2, mask=sm, other=float("-inf"))
    l = tl.load(PML + base * 2 + 1, mask=sm, other=0.0)
    top = tl.max(m, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(m - top)
    denom = tl.sum(w * l, 0)
    acc = tl.load(PO + base[:, None] * D + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.maximum(denom, 1e-30)
    tl.store(O + b * so_b + h * so_h + d, out.to(O.dtype.element_ty), mask=dm)


def decode_splits(batch: int, n_kv: int, max_pos: int, block_n: int, device: torch.device) -> int:
    """Splits of the positions per (sequence, KV head): at most 512 positions a split, and enough
    programs to fill the GPU four times over (at most 16 splits, each at least `block_n` positions)."""
    if device.type != "cuda":
        return min(2, max(1, -(-max_pos // block_n)))  # the interpreter: exercise the combine
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = max(-(-4 * sms // max(1, batch * n_kv)), -(-max_pos // 512))
    return max(1, min(want, -(-max_pos // block_n), 16))


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
    n_splits: int | None = None,
    *,
    rope: tuple | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Triton launcher of `condmem.ops.attention.paged_decode_attention` (same contract), and with
    ``rope=(k, v, cos, sin)`` of `decode_attention_rope_store` (q unrotated); `block_n`
    (positions a loop step), `num_warps` and `num_stages` for tuning sweeps."""
    batch, n_heads, head_dim = q.shape
    _, block_size, n_kv, _ = k_pool.shape
    rep = n_heads // n_kv
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    block_n = block_n or (64 if not interpreting() else 16)
    splits, split_len = _split_positions(batch, n_kv, block_table.shape[1] * block_size, block_n, n_splits, q.device)
    out = torch.empty_like(q)
    ieee = q.dtype == torch.float32
    part_o, part_ml = _split_partials(out, splits)
    rope_args = _rope_args(q, rope)
    _decode_split_kernel[(batch, n_kv, splits)](
        q,
        k_pool,
        v_pool,
        block_table,
        lengths,
        out,
        part_o,
        part_ml,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        k_pool.stride(2),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        split_len,
        splits,
        n_heads,
        scale * LOG2E,
        *rope_args,
        REP=rep,
        REP_P=max(16, next_pow2(rep)),
        D=head_dim,
        DP=max(16, next_pow2(head_dim)),
        BS=block_size,
        BLOCK_N=block_n,
        DIRECT=splits == 1,
        IEEE=ieee,
        OFF64=max(k_pool.numel(), v_pool.numel()) >= 2**31,
        ROPE=rope is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits > 1:
        _combine_splits(part_o, part_ml, out, lengths, split_len, splits)
    return out


def _split_positions(
    batch: int, n_kv: int, max_pos: int, block_n: int, n_splits: int | None, device: torch.device
) -> tuple[int, int]:
    """(splits, positions a split) for `max_pos` positions: `n_splits` (default `decode_splits`)
    rounded so that each split's length is a multiple of `block_n` and none is empty."""
    splits = n_splits or decode_splits(batch, n_kv, max_pos, block_n, device)
    split_len = -(-(-(-max_pos // splits)) // block_n) * block_n
    return -(-max_pos // split_len), split_len


def _split_partials(out: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The splits' partial outputs [B, H, S, D] and (max, sum) [B, H, S, 2] in fp32; one split
    writes `out` itself, which then stands in for both."""
    if splits == 1:
        return out, out
    batch, n_heads, head_dim = out.shape
    part_o = torch.empty(batch, n_heads, splits, head_dim, dtype=torch.float32, device=out.device)
    part_ml = torch.empty(batch, n_heads, splits, 2, dtype=torch.float32, device=out.device)
    return part_o, part_ml


def _rope_args(q: torch.Tensor, rope: tuple | None) -> tuple:
    """The decode kernel's RoPE arguments (KN, VN, COS, SIN and their strides); stand-ins without `rope`."""
    if rope is None:
        return (q, q, q, q, 0, 0, 0, 0, 0)
    k_new, v_new, cos, sin = rope
    assert q.stride(2) == 1 and k_new.stride(2) == 1 and v_new.stride(2) == 1 and cos.stride(1) == 1
    return (
        k_new,
        v_new,
        cos,
        sin,
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        cos.stride(0),
    )


def _combine_splits(
    part_o: torch.Tensor, part_ml: torch.Tensor, out: torch.Tensor, lengths: torch.Tensor, split_len: int, splits: int
) -> None:
    """`_decode_combine_kernel`: each sequence's split partials into `out` [B, H, D] (one program a head)."""
    batch, n_heads, head_dim = out.shape
    _decode_combine_kernel[(batch, n_heads)](
        part_o,
        part_ml,
        out,
        lengths,
        out.stride(0),
        out.stride(1),
        split_len,
        splits,
        n_heads,
        S_P=next_pow2(splits),
        D=head_dim,
        DP=max(16, next_pow2(head_dim)),
        num_warps=1,
    )


@triton.jit
def _prefill_kernel(
    Q,
    K,
    V,
    BT,
    CU,
    STARTS,
    O,
    sq_n,
    sq_h,
    sk_blk,
    sk_pos,
    sk_h,
    sbt_b,
    so_n,
    so_h,
    scale_log2,
    REP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    mb = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q0 = tl.load(CU + b).to(tl.int64)
    q_len = (tl.load(CU + b + 1) - q0).to(tl.int32)
    m0 = mb * BLOCK_M
    if m0 < q_len:
        ctx = tl.load(STARTS + b).to(tl.int32)
        kvh = h // REP
        offs = m0 + tl.arange(0, BLOCK_M)
        qm = offs < q_len
        q_pos = ctx + offs
        d = tl.arange(0, DP)
        dm = d < D
        rows = q0 + offs
        q = tl.load(Q + rows[:, None] * sq_n + h * sq_h + d[None, :], mask=qm[:, None] & dm[None, :], other=0.0)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DP], tl.float32)
        kv_end = ctx + tl.minimum(m0 + BLOCK_M, q_len)
        bt_row = BT + b.to(tl.int64) * sbt_b
        for n0 in range(0, kv_end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pm = pos < kv_end
            blk = tl.load(bt_row + pos // BS, mask=pm, other=0).to(tl.int64)
            off = blk * sk_blk + (pos % BS) * sk_pos + kvh * sk_h
            k = tl.load(K + off[:, None] + d[None, :], mask=pm[:, None] & dm[None, :], other=0.0)
            v = tl.load(V + off[:, None] + d[None, :], mask=pm[:, None] & dm[None, :], other=0.0)
            ok = pm[None, :] & (pos[None, :] <= q_pos[:, None])
            m, l, acc = _online_softmax_step(q, k, v, ok, m, l, acc, scale_log2, IEEE)
        out = acc / l[:, None]
        tl.store(
            O + rows[:, None] * so_n + h * so_h + d[None, :], out.to(O.dtype.element_ty), mask=qm[:, None] & dm[None, :]
        )


def paged_prefill_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    max_q_len: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Triton launcher of `condmem.ops.attention.paged_prefill_attention` (same contract)."""
    n, n_heads, head_dim = q.shape
    _, block_size, n_kv, _ = k_pool.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty_like(q)
    batch = cu_seqlens.numel() - 1
    if n == 0 or batch == 0 or max_q_len == 0:
        return out
    block_m, block_n = (64, 64) if not interpreting() else (16, 16)
    _prefill_kernel[(-(-max_q_len // block_m), batch, n_heads)](
        q,
        k_pool,
        v_pool,
        block_table,
        cu_seqlens,
        starts,
        out,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        k_pool.stride(2),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        scale * LOG2E,
        REP=n_heads // n_kv,
        D=head_dim,
        DP=max(16, next_pow2(head_dim)),
        BS=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32,
        num_warps=4,
        num_stages=2,
    )
    return out


@triton.jit
def _rope_store_kernel(
    Q,
    K,
    V,
    COS,
    SIN,
    POS,
    SLOT,
    VALID,
    BT,
    KP,
    VP,
    QO,
    sq_n,
    sq_h,
    sk_n,
    sk_h,
    sv_n,
    sv_h,
    scos,
    sbt_b,
    sp_blk,
    sp_pos,
    sp_h,
    sqo_n,
    sqo_h,
    H: tl.constexpr,
    KV: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    BS: tl.constexpr,
    H_P: tl.constexpr,
    KV_P: tl.constexpr,
    HAS_VALID: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + n)
    j = tl.arange(0, HALF_P)
    jm = j < HALF
    c = tl.load(COS + pos * scos + j, mask=jm, other=0.0)[None, :]
    s = tl.load(SIN + pos * scos + j, mask=jm, other=0.0)[None, :]
    hq = tl.arange(0, H_P)
    qmask = (hq < H)[:, None] & jm[None, :]
    qp = Q + n * sq_n + hq[:, None] * sq_h + j[None, :]
    x1 = tl.load(qp, mask=qmask, other=0.0).to(tl.float32)
    x2 = tl.load(qp + HALF, mask=qmask, other=0.0).to(tl.float32)
    op = QO + n * sqo_n + hq[:, None] * sqo_h + j[None, :]
    tl.store(op, (x1 * c - x2 * s).to(QO.dtype.element_ty), mask=qmask)
    tl.store(op + HALF, (x1 * s + x2 * c).to(QO.dtype.element_ty), mask=qmask)
    keep = True
    if HAS_VALID:
        keep = tl.load(VALID + n) != 0
    if keep:
        hk = tl.arange(0, KV_P)
        kmask = (hk < KV)[:, None] & jm[None, :]
        kp = K + n * sk_n + hk[:, None] * sk_h + j[None, :]
        y1 = tl.load(kp, mask=kmask, other=0.0).to(tl.float32)
        y2 = tl.load(kp + HALF, mask=kmask, other=0.0).to(tl.float32)
        slot = tl.load(SLOT + n)
        blk = tl.load(BT + slot * sbt_b + pos // BS).to(tl.int64)
        dest = blk * sp_blk + (pos % BS) * sp_pos + hk[:, None] * sp_h + j[None, :]
        tl.store(KP + dest, (y1 * c - y2 * s).to(KP.dtype.element_ty), mask=kmask)
        tl.store(KP + dest + HALF, (y1 * s + y2 * c).to(KP.dtype.element_ty), mask=kmask)
        vp = V + n * sv_n + hk[:, None] * sv_h + j[None, :]
        tl.store(VP + dest, tl.load(vp, mask=kmask, other=0.0).to(VP.dtype.element_ty), mask=kmask)
        tl.store(VP + dest + HALF, tl.load(vp + HALF, mask=kmask, other=0.0).to(VP.dtype.element_ty), mask=kmask)


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
) -> torch.Tensor:
    """Triton launcher of `condmem.ops.attention.rope_store` (same contract)."""
    n, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    q_rot = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if n == 0:
        return q_rot
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and cos.stride(1) == 1
    _rope_store_kernel[(n,)](
        q,
        k,
        v,
        cos,
        sin,
        pos,
        slot_of,
        valid if valid is not None else pos,
        block_table,
        k_pool,
        v_pool,
        q_rot,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        block_table.stride(0),
        k_pool.stride(0),
        k_pool.stride(1),
        k_pool.stride(2),
        q_rot.stride(0),
        q_rot.stride(1),
        H=n_heads,
        KV=n_kv,
        HALF=head_dim // 2,
        HALF_P=next_pow2(head_dim // 2),
        BS=k_pool.shape[1],
        H_P=next_pow2(n_heads),
        KV_P=next_pow2(n_kv),
        HAS_VALID=valid is not None,
        num_warps=4,
    )
    return q_rot
