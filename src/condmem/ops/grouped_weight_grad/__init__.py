"""The weight gradient of a grouped GEMM whose groups are row ranges: ``dW_g = dY_g^T X_g`` for each group.

A MoE layer's experts run as one grouped GEMM over an expert-sorted buffer, ``Y_g = X_g W_g^T``
for the rows of group g. The input's gradient is again such a GEMM (``dX_g = dY_g W_g``); the
weight's is a GEMM whose contraction runs over each group's rows. `grouped_weight_grad(grad_out,
x, ends, out_dtype)` computes it: `grad_out` [M, N] and `x` [M, K] (bf16, rows contiguous), `ends`
(int32 [G]) the end of each group's rows, the first beginning at 0; returns [G, N, K] in
`out_dtype`, accumulated in fp32 (so an fp32 master weight takes its gradient with no bf16
rounding between).

On CUDA, a Triton kernel (`triton.py`) registered as an op that `torch.compile` keeps in its graph;
elsewhere, the reference (`reference.py`): one fp32 matmul per group.
"""

from __future__ import annotations

import torch

from condmem.ops.grouped_weight_grad.reference import grouped_weight_grad_reference
from condmem.ops.triton_util import resolve_backend


def grouped_weight_grad(
    grad_out: torch.Tensor, x: torch.Tensor, ends: torch.Tensor, out_dtype: torch.dtype, backend: str | None = None
) -> torch.Tensor:
    """[G, N, K]: ``grad_out[rows_g].T @ x[rows_g]`` per group (see the module); `backend`: see
    `triton_util.resolve_backend`."""
    _check(grad_out, x, ends, out_dtype)
    if resolve_backend(backend, x.device, "grouped_weight_grad") == "torch":
        return grouped_weight_grad_reference(grad_out, x, ends, out_dtype)
    from condmem.ops.grouped_weight_grad.triton import grouped_weight_grad_triton

    return grouped_weight_grad_triton(grad_out, x, ends, out_dtype)


def _check(grad_out: torch.Tensor, x: torch.Tensor, ends: torch.Tensor, out_dtype: torch.dtype) -> None:
    """Shapes and dtypes, on the host (that `ends` ends at M is the caller's: reading it would sync)."""
    if grad_out.dim() != 2 or x.dim() != 2 or grad_out.shape[0] != x.shape[0]:
        raise ValueError(
            f"grouped_weight_grad: grad_out [M, N] and x [M, K] must be 2-D with the same rows, got "
            f"{tuple(grad_out.shape)} and {tuple(x.shape)}"
        )
    if ends.dim() != 1 or ends.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"grouped_weight_grad: ends must be 1-D int32/int64, got {ends.dtype} {tuple(ends.shape)}")
    if grad_out.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("grouped_weight_grad: grad_out and x need contiguous rows (stride 1 along the last dim)")
    if not out_dtype.is_floating_point:
        raise ValueError(f"grouped_weight_grad: out_dtype must be a float dtype, got {out_dtype}")


__all__ = ["grouped_weight_grad", "grouped_weight_grad_reference"]
