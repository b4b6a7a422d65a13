"""The Engram gate fused into Triton kernels: forward, and backward for training.

Computes what `condmem.ops.gate.engram_gate_reference` computes, in float32. The forward
runs one program per (token, branch), a token's branches adjacent (the shared value read
from HBM once), in two passes over D (`_gate_fwd_chunked_kernel`); the backward one program
per token::

    q_m = RMSNorm(h_m) * q_weight[m]         k_m = RMSNorm(key_m) * k_weight[m]
    s_m = <q_m, k_m> / sqrt(D)
    g_m = sign(s_m) * sqrt(max(|s_m|, clamp))
    out_m = sigmoid(g_m) * token_mask * v

Backward, per token and branch (a = sigmoid(g), c = da * a(1-a) * g'(s) / sqrt(D),
g'(s) = 1 / (2 sqrt|s|) where |s| >= clamp, else 0; y = x * rsqrt(mean x^2 + eps))::

    dv       = sum_m a_m * dout_m
    dh_m     = rh * (u - yh * mean(u * yh)),   u = c * k_m * q_weight[m]
    dkey_m   = rk * (w - yk * mean(w * yk)),   w = c * q_m * k_weight[m]
    dq_weight[m] = k_weight[m] * S[m],  dk_weight[m] = q_weight[m] * S[m],
    S[m]     = sum_t c * rh * rk * h_m * key_m

The first kernel writes dh, dkv and the per-(token, branch) coefficient ``c*rh*rk``;
a second reduces S over tokens in fixed chunks (deterministic, no atomics).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from condmem.ops.launch import FastLaunch
from condmem.ops.triton_util import cdiv, next_pow2

MAX_CHUNKS = 16


@functools.lru_cache(maxsize=64)
def default_launch(dim: int) -> tuple[int, int]:
    """(chunk, warps) of the forward: the whole row in one chunk up to 8192 wide, 32 elements a
    thread. Narrower chunks, and 16 warps, stayed further from the copy bound in the launch
    sweep with the residual add (`benchmarks/kernel_sweep.py`; docs/kernels.md)."""
    chunk = min(next_pow2(dim), 8192)
    return chunk, max(1, chunk // 1024)


def _bwd_warps(block_d: int) -> int:
    return 4 if block_d <= 1024 else 8  # 8 warps beat 16 in the kernel benchmark (docs/benchmarks.md)


@triton.jit
def _gate_of_score(s, clamp):
    """g = sign(s) * sqrt(max(|s|, clamp)) and the gate a = sigmoid(g) of a score s (float32)."""
    sgn = tl.where(s > 0, 1.0, tl.where(s < 0, -1.0, 0.0))
    g = sgn * tl.sqrt_rn(tl.maximum(tl.abs(s), clamp))
    return g, 1.0 / (1.0 + tl.exp(-g))


@triton.jit
def _branch_scalars(h, k, qw, kw, inv_d, eps, inv_sqrt_d, clamp):
    """RMS factors, normalized vectors and the gate of one branch (all float32)."""
    rh = 1.0 / tl.sqrt_rn(tl.sum(h * h, axis=0) * inv_d + eps)
    rk = 1.0 / tl.sqrt_rn(tl.sum(k * k, axis=0) * inv_d + eps)
    qn = h * rh * qw
    kn = k * rk * kw
    s = tl.sum(qn * kn, axis=0) * inv_sqrt_d
    g, a = _gate_of_score(s, clamp)
    # a * (1 - a) without the cancellation of 1 - a near a = 1 (and no inf * 0 for large |g|).
    da_dg = 1.0 / ((1.0 + tl.exp(-g)) * (1.0 + tl.exp(g)))
    return rh, rk, qn, kn, s, a, da_dg


@triton.jit
def _gate_fwd_chunked_kernel(
    h_ptr,
    kv_ptr,
    qw_ptr,
    kw_ptr,
    mask_ptr,
    out_ptr,
    D,
    h_stride,
    kv_stride,
    out_stride,
    eps,
    clamp,
    inv_d,
    inv_sqrt_d,
    HC: tl.constexpr,
    CHUNK: tl.constexpr,
    N_CHUNKS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    RESIDUAL: tl.constexpr,
):
    """One program per (token, branch) in two passes over D in chunks: the three sums (h.h, k.k,
    h.qw.k.kw) first, then the output from the value (and the hidden state, re-read from L2).
    Few registers per thread, so many programs per SM keep many loads in flight. A token's
    branches are adjacent programs (its value read from HBM once)."""
    pid = tl.program_id(0)
    t = (pid // HC).to(tl.int64)
    m = pid % HC
    c = tl.arange(0, CHUNK)
    h_row = h_ptr + t * h_stride + m * D
    k_row = kv_ptr + t * kv_stride + m * D
    v_row = kv_ptr + t * kv_stride + HC * D
    hh = tl.zeros([CHUNK], dtype=tl.float32)
    kk = tl.zeros([CHUNK], dtype=tl.float32)
    hk = tl.zeros([CHUNK], dtype=tl.float32)
    for i in tl.static_range(N_CHUNKS):
        d = i * CHUNK + c
        dm = d < D
        h = tl.load(h_row + d, mask=dm, other=0).to(tl.float32)
        k = tl.load(k_row + d, mask=dm, other=0).to(tl.float32)
        qw = tl.load(qw_ptr + m * D + d, mask=dm, other=0).to(tl.float32)
        kw = tl.load(kw_ptr + m * D + d, mask=dm, other=0).to(tl.float32)
        hh += h * h
        kk += k * k
        hk += (h * qw) * (k * kw)
    rh = 1.0 / tl.sqrt_rn(tl.sum(hh, axis=0) * inv_d + eps)
    rk = 1.0 / tl.sqrt_rn(tl.sum(kk, axis=0) * inv_d + eps)
    s = tl.sum(hk, axis=0) * (rh * rk) * inv_sqrt_d
    _, a = _gate_of_score(s, clamp)
    if HAS_MASK:
        a = a * (tl.load(mask_ptr + t) != 0).to(tl.float32)
    for i in tl.static_range(N_CHUNKS):
        d = i * CHUNK + c
        dm = d < D
        y = a * tl.load(v_row + d, mask=dm, other=0).to(tl.float32)
        if RESIDUAL:
            y = y + tl.load(h_row + d, mask=dm, other=0).to(tl.float32)
        tl.store(out_ptr + t * out_stride + m * D + d, y.to(out_ptr.dtype.element_ty), mask=dm)


_GATE_FWD = FastLaunch(_gate_fwd_chunked_kernel)


@triton.jit
def _gate_bwd_kernel(
    h_ptr,
    kv_ptr,
    qw_ptr,
    kw_ptr,
    mask_ptr,
    dout_ptr,
    dh_ptr,
    dkv_ptr,
    coef_ptr,
    D,
    h_stride,
    kv_stride,
    dout_stride,
    dh_stride,
    dkv_stride,
    eps,
    clamp,
    inv_d,
    inv_sqrt_d,
    HC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_MASK: tl.constexpr,
    RESIDUAL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    v = tl.load(kv_ptr + t * kv_stride + HC * D + d, mask=dm, other=0).to(tl.float32)
    keep = 1.0
    if HAS_MASK:
        keep = (tl.load(mask_ptr + t) != 0).to(tl.float32)
    dv = tl.zeros([BLOCK_D], dtype=tl.float32)
    for m in tl.static_range(HC):
        h = tl.load(h_ptr + t * h_stride + m * D + d, mask=dm, other=0).to(tl.float32)
        k = tl.load(kv_ptr + t * kv_stride + m * D + d, mask=dm, other=0).to(tl.float32)
        qw = tl.load(qw_ptr + m * D + d, mask=dm, other=0).to(tl.float32)
        kw = tl.load(kw_ptr + m * D + d, mask=dm, other=0).to(tl.float32)
        go = tl.load(dout_ptr + t * dout_stride + m * D + d, mask=dm, other=0).to(tl.float32)
        rh, rk, qn, kn, s, a, da_dg = _branch_scalars(h, k, qw, kw, inv_d, eps, inv_sqrt_d, clamp)
        dv += (a * keep) * go
        da = tl.sum(go * v, axis=0) * keep
        abs_s = tl.abs(s)
        dgds = tl.where(abs_s >= clamp, 0.5 / tl.sqrt_rn(tl.maximum(abs_s, clamp)), 0.0)
        c = da * da_dg * dgds * inv_sqrt_d
        yh = h * rh
        yk = k * rk
        u = c * kn * qw
        w = c * qn * kw
        dh = rh * (u - yh * (tl.sum(u * yh, axis=0) * inv_d))
        dk = rk * (w - yk * (tl.sum(w * yk, axis=0) * inv_d))
        if RESIDUAL:
            dh = dh + go  # out = h + gate * v: the identity path
        tl.store(dh_ptr + t * dh_stride + m * D + d, dh.to(dh_ptr.dtype.element_ty), mask=dm)
        tl.store(dkv_ptr + t * dkv_stride + m * D + d, dk.to(dkv_ptr.dtype.element_ty), mask=dm)
        tl.store(coef_ptr + t * HC + m, c * rh * rk)
    tl.store(dkv_ptr + t * dkv_stride + HC * D + d, dv.to(dkv_ptr.dtype.element_ty), mask=dm)


@triton.jit
def _gate_wgrad_kernel(
    h_ptr,
    kv_ptr,
    coef_ptr,
    part_ptr,
    n_tokens,
    D,
    h_stride,
    kv_stride,
    tokens_per_split,
    HC: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """S[split, m, d] = sum over the split's tokens of coef[t, m] * h[t, m, d] * key[t, m, d]."""
    pd = tl.program_id(0)
    m = tl.program_id(1)
    split = tl.program_id(2)
    d = pd * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    start = split.to(tl.int64) * tokens_per_split  # int64 loop index: t * stride cannot overflow
    stop = tl.minimum(start + tokens_per_split, n_tokens)
    for t in range(start, stop):
        cf = tl.load(coef_ptr + t * HC + m)
        h = tl.load(h_ptr + t * h_stride + m * D + d, mask=dm, other=0).to(tl.float32)
        k = tl.load(kv_ptr + t * kv_stride + m * D + d, mask=dm, other=0).to(tl.float32)
        acc += cf * h * k
    tl.store(part_ptr + (split * HC + m) * D + d, acc, mask=dm)


def _flatten(hidden: torch.Tensor, kv: torch.Tensor, token_mask: torch.Tensor | None):
    *lead, hc, dim = hidden.shape
    if kv.shape[:-1] != hidden.shape[:-2] or kv.shape[-1] != (hc + 1) * dim:
        raise ValueError(f"kv must be [..., (hc+1)*D] = {(*lead, (hc + 1) * dim)}, got {tuple(kv.shape)}")
    h2 = hidden.reshape(-1, hc * dim)
    kv2 = kv.reshape(-1, (hc + 1) * dim)
    if h2.stride(-1) != 1:
        h2 = h2.contiguous()
    if kv2.stride(-1) != 1:
        kv2 = kv2.contiguous()
    mask = None
    if token_mask is not None:
        if token_mask.shape != hidden.shape[:-2]:
            raise ValueError(f"token_mask must be {tuple(lead)}, got {tuple(token_mask.shape)}")
        mask = token_mask.reshape(-1).contiguous().view(torch.uint8)
    return h2, kv2, mask, hc, dim


@functools.lru_cache(maxsize=256)
def _forward_launch(dim: int, chunk: int | None, num_warps: int | None) -> tuple[int, int, int, float, float]:
    """(chunk, chunks, warps, 1/D, 1/sqrt(D)) of the forward: worked out once per width and request."""
    auto_chunk, auto_warps = default_launch(dim)
    chunk = min(max(next_pow2(chunk or auto_chunk), next_pow2(cdiv(dim, MAX_CHUNKS))), next_pow2(dim))
    return chunk, cdiv(dim, chunk), num_warps or auto_warps, 1.0 / dim, 1.0 / math.sqrt(dim)


def gate_forward_triton(
    hidden,
    kv,
    q_weight,
    k_weight,
    eps,
    clamp,
    token_mask=None,
    *,
    residual: bool = False,
    chunk: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Fused forward: [..., hc, D] hidden, [..., (hc+1)*D] kv -> [..., hc, D] in hidden's dtype;
    with `residual`, ``hidden + gate * v`` (the add in fp32, rounded once).

    `chunk` and `num_warps` (default `default_launch`) are the launch configuration
    (`benchmarks/kernel_sweep.py` times them). The chunk loop unrolls at compile time, so a
    chunk is widened to at most `MAX_CHUNKS` chunks a row (narrower ones compiled for minutes).
    """
    h2, kv2, mask, hc, dim = _flatten(hidden, kv, token_mask)
    n = h2.shape[0]
    out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    if n == 0:
        return out
    o2 = out.view(n, hc * dim)
    chunk, n_chunks, num_warps, inv_d, inv_sqrt_d = _forward_launch(dim, chunk, num_warps)
    _GATE_FWD(
        (n * hc,),
        (h2, kv2, q_weight.contiguous(), k_weight.contiguous(), mask if mask is not None else h2, o2),
        (dim, h2.stride(0), kv2.stride(0), o2.stride(0)),
        (float(eps), float(clamp), inv_d, inv_sqrt_d),
        num_warps,
        HC=hc,
        CHUNK=chunk,
        N_CHUNKS=n_chunks,
        HAS_MASK=mask is not None,
        RESIDUAL=residual,
    )
    return out


def gate_backward_triton(
    dout,
    hidden,
    kv,
    q_weight,
    k_weight,
    eps,
    clamp,
    token_mask=None,
    *,
    residual: bool = False,
    num_warps: int | None = None,
):
    """Gradients (d hidden, d kv, d q_weight, d k_weight) of the fused gate (with `residual`,
    of ``hidden + gate * v``)."""
    h2, kv2, mask, hc, dim = _flatten(hidden, kv, token_mask)
    n = h2.shape[0]
    dh = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    dkv = torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)
    if n == 0:
        return dh, dkv, torch.zeros_like(q_weight), torch.zeros_like(k_weight)
    do2 = dout.reshape(n, hc * dim)
    if do2.stride(-1) != 1:
        do2 = do2.contiguous()
    dh2, dkv2 = dh.view(n, hc * dim), dkv.view(n, (hc + 1) * dim)
    coef = torch.empty((n, hc), dtype=torch.float32, device=hidden.device)
    qw, kw = q_weight.contiguous(), k_weight.contiguous()
    block_d = next_pow2(dim)
    _gate_bwd_kernel[(n,)](
        h2,
        kv2,
        qw,
        kw,
        mask if mask is not None else h2,
        do2,
        dh2,
        dkv2,
        coef,
        dim,
        h2.stride(0),
        kv2.stride(0),
        do2.stride(0),
        dh2.stride(0),
        dkv2.stride(0),
        float(eps),
        float(clamp),
        1.0 / dim,
        1.0 / math.sqrt(dim),
        HC=hc,
        BLOCK_D=block_d,
        HAS_MASK=mask is not None,
        RESIDUAL=residual,
        num_warps=num_warps or _bwd_warps(block_d),
    )
    # Weight gradients: fixed token chunks per program, partial sums added in torch.
    wblock = min(next_pow2(dim), 1024)
    n_dblocks = cdiv(dim, wblock)
    target = 4 * 132 if hidden.is_cuda else 2
    splits = max(1, min(n, target // max(1, n_dblocks * hc)))
    per_split = cdiv(n, splits)
    splits = cdiv(n, per_split)
    part = torch.empty((splits, hc, dim), dtype=torch.float32, device=hidden.device)
    _gate_wgrad_kernel[(n_dblocks, hc, splits)](
        h2,
        kv2,
        coef,
        part,
        n,
        dim,
        h2.stride(0),
        kv2.stride(0),
        per_split,
        HC=hc,
        BLOCK_D=wblock,
        num_warps=4,
    )
    s = part.sum(dim=0)
    dqw = (kw.float() * s).to(q_weight.dtype)
    dkw = (qw.float() * s).to(k_weight.dtype)
    return dh, dkv, dqw, dkw


class EngramGateFunction(torch.autograd.Function):
    """Autograd wrapper: Triton forward, Triton backward (inputs saved, scalars recomputed)."""

    @staticmethod
    def forward(ctx, hidden, kv, q_weight, k_weight, token_mask, eps, clamp, residual):
        ctx.save_for_backward(hidden, kv, q_weight, k_weight, token_mask)
        ctx.eps, ctx.clamp, ctx.residual = eps, clamp, residual
        return gate_forward_triton(hidden, kv, q_weight, k_weight, eps, clamp, token_mask, residual=residual)

    @staticmethod
    def backward(ctx, dout):
        hidden, kv, q_weight, k_weight, token_mask = ctx.saved_tensors
        dh, dkv, dqw, dkw = gate_backward_triton(
            dout, hidden, kv, q_weight, k_weight, ctx.eps, ctx.clamp, token_mask, residual=ctx.residual
        )
        return (
            dh if ctx.needs_input_grad[0] else None,
            dkv if ctx.needs_input_grad[1] else None,
            dqw if ctx.needs_input_grad[2] else None,
            dkw if ctx.needs_input_grad[3] else None,
            None,
            None,
            None,
            None,
        )


def engram_gate_triton(
    hidden, kv, q_weight, k_weight, eps=1e-6, clamp=1e-6, token_mask=None, residual: bool = False
) -> torch.Tensor:
    """The fused gate; differentiable (Triton backward) when any input requires grad."""
    if torch.is_grad_enabled() and (
        hidden.requires_grad or kv.requires_grad or q_weight.requires_grad or k_weight.requires_grad
    ):
        return EngramGateFunction.apply(hidden, kv, q_weight, k_weight, token_mask, eps, clamp, residual)
    return gate_forward_triton(hidden, kv, q_weight, k_weight, eps, clamp, token_mask, residual=residual)
