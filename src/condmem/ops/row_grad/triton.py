"""Triton kernel of `row_sums`: one program per distinct row sums its run of gradient rows.

A run is read ``UNROLL`` rows at a time (independent loads in flight: a frequent n-gram's
run can be thousands of lookups long, and one load at a time would leave its program
waiting on memory), and the rows are added one after another in run order, so the sum is
the sequential fp32 sum ``torch.sparse`` coalescing computes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

UNROLL = 8


@triton.jit
def _row_sums_kernel(grad_ptr, order_ptr, ends_ptr, out_ptr, dim, stride_g, stride_o,
                     BLOCK_D: tl.constexpr, UNROLL: tl.constexpr):  # fmt: skip
    u = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    end = tl.load(ends_ptr + u)
    start = tl.load(ends_ptr + u - 1, mask=u > 0, other=0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for first in range(start, end, UNROLL):
        for r in tl.static_range(UNROLL):
            j = first + r
            live = j < end
            src = tl.load(order_ptr + j, mask=live, other=0)
            # A masked row adds +0.0, which leaves the sum's bits alone (it is never -0.0).
            row_ok = col_ok & ((cols * 0 + j) < end)
            acc += tl.load(grad_ptr + src * stride_g + cols, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + u.to(tl.int64) * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def row_sums_triton(grad_rows: torch.Tensor, order: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    if grad_rows.stride(1) != 1:
        grad_rows = grad_rows.contiguous()
    k, dim = ends.numel(), grad_rows.shape[1]
    out = torch.empty(k, dim, dtype=grad_rows.dtype, device=grad_rows.device)
    if k:
        block = triton.next_power_of_2(dim)
        _row_sums_kernel[(k,)](
            grad_rows, order, ends, out, dim, grad_rows.stride(0), out.stride(0),
            BLOCK_D=block, UNROLL=UNROLL, num_warps=1 if block <= 64 else 4,
        )  # fmt: skip
    return out
