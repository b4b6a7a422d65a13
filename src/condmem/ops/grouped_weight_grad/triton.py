"""Triton kernel of `grouped_weight_grad`: one program per (group, output tile), looping over the group's rows.

Program p computes tile (n, k) of group g's ``dY_g^T X_g`` ([BLOCK_N, BLOCK_K], fp32 accumulator): it
walks the group's rows ``ends[g-1]:ends[g]`` in steps of BLOCK_M, multiplying the transposed row block
of dY by the row block of X. Each tile is owned by one program, so there are no atomics and the sum
order is fixed: the same bits on every run. A group's tiles are neighbours in the launch order, so
they read its rows while they are in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from condmem.ops.triton_util import interpreting

_INTERPRET = interpreting()  # as triton decided when it was imported


@triton.jit
def _weight_grad(
    dy_ptr, x_ptr, ends_ptr, out_ptr, n, k, stride_dy, stride_x,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(n, BLOCK_N)
    tiles_k = tl.cdiv(k, BLOCK_K)
    g = pid // (tiles_n * tiles_k)
    t = pid % (tiles_n * tiles_k)
    offs_n = (t // tiles_k) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = (t % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    start = tl.load(ends_ptr + g - 1, mask=g > 0, other=0).to(tl.int64)
    end = tl.load(ends_ptr + g).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m in range(start, end, BLOCK_M):
        r = m + rows
        live = r < end
        dy = tl.load(
            dy_ptr + r[:, None] * stride_dy + offs_n[None, :], mask=live[:, None] & (offs_n < n)[None, :], other=0.0
        )
        x = tl.load(
            x_ptr + r[:, None] * stride_x + offs_k[None, :], mask=live[:, None] & (offs_k < k)[None, :], other=0.0
        )
        if UPCAST:  # the interpreter's bf16 dot is wrong (Triton 3.9); widened, the products are exact
            dy, x = dy.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(tl.trans(dy), x, acc)
    out = out_ptr + g.to(tl.int64) * n * k + offs_n[:, None] * k + offs_k[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_n < n)[:, None] & (offs_k < k)[None, :])


def tiling(k: int) -> tuple[int, int, int, int, int]:
    """(block_n, block_k, block_m, warps, stages) for inputs `k` wide: fixed by the shape, so a gradient's
    bits never depend on a tuner's pick. The fastest of seven tilings at a MoE's two GEMMs on an H100
    (``benchmarks/probes/grouped_mm_backward.py``): one tile spans the whole width up to 256."""
    return (128, 256, 64, 8, 3) if k <= 256 else (128, 128, 64, 4, 4)


# An opaque op: a compiled graph (and its CUDA graph) calls the kernel as eager does.
@torch.library.custom_op("condmem::grouped_weight_grad", mutates_args=())
def grouped_weight_grad_triton(
    grad_out: torch.Tensor, x: torch.Tensor, ends: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """`grouped_weight_grad` by the kernel, in the shape's `tiling`."""
    return weight_grad_tiled(grad_out, x, ends, out_dtype, *tiling(x.shape[1]))


@grouped_weight_grad_triton.register_fake
def _(grad_out: torch.Tensor, x: torch.Tensor, ends: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return x.new_empty(ends.shape[0], grad_out.shape[1], x.shape[1], dtype=out_dtype)


def weight_grad_tiled(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    ends: torch.Tensor,
    out_dtype: torch.dtype,
    block_n: int,
    block_k: int,
    block_m: int,
    num_warps: int,
    num_stages: int,
) -> torch.Tensor:
    """The kernel in a given tiling (the probe compares tilings; the op uses `tiling`)."""
    n = grad_out.shape[1]
    k = x.shape[1]
    groups = ends.numel()
    out = torch.empty(groups, n, k, dtype=out_dtype, device=x.device)
    if groups == 0:
        return out
    grid = (groups * triton.cdiv(n, block_n) * triton.cdiv(k, block_k),)
    _weight_grad[grid](
        grad_out, x, ends, out, n, k, grad_out.stride(0), x.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_M=block_m, UPCAST=_INTERPRET,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
