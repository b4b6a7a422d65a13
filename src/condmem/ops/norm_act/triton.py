"""Triton kernels of `condmem.ops.norm_act`: one program per row (RMSNorm), flat blocks (silu_mul)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from condmem.ops.triton_util import next_pow2


@triton.jit
def _rms_norm_kernel(X, R, W, XO, Y, D, eps, BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(X + row * D + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(R + row * D + cols, mask=mask, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
        tl.store(XO + row * D + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
    normed = (xf * inv).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * D + cols, (normed * w).to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    dim = x.shape[-1]
    x = x.contiguous()
    rows = x.numel() // dim
    y = torch.empty_like(x)
    x_out = torch.empty_like(x) if residual is not None else x
    if rows:
        res = residual.contiguous() if residual is not None else x
        _rms_norm_kernel[(rows,)](
            x,
            res,
            weight,
            x_out,
            y,
            dim,
            eps,
            BLOCK=next_pow2(dim),
            HAS_RES=residual is not None,
            num_warps=4 if dim <= 4096 else 8,
        )
    return y if residual is None else (x_out, y)


@triton.jit
def _silu_mul_kernel(A, B, O, cols, sa, sb, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < cols
    a = tl.load(A + row * sa + c, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + row * sb + c, mask=mask, other=0.0).to(tl.float32)
    silu = (a / (1.0 + tl.exp(-a))).to(O.dtype.element_ty).to(tl.float32)
    tl.store(O + row * cols + c, (silu * b).to(O.dtype.element_ty), mask=mask)


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rows may be strided (e.g. the two halves of one fused projection); each row's last dim contiguous."""
    cols = a.shape[-1]
    a2 = a if a.dim() == 2 and a.stride(-1) == 1 else a.reshape(-1, cols).contiguous()
    b2 = b if b.dim() == 2 and b.stride(-1) == 1 else b.reshape(-1, cols).contiguous()
    out = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    rows = a2.shape[0]
    if rows and cols:
        block = 1024
        _silu_mul_kernel[(rows, triton.cdiv(cols, block))](
            a2, b2, out, cols, a2.stride(0), b2.stride(0), BLOCK=block, num_warps=4
        )
    return out
