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
    if resolve_backend(backend, x.device, "grouped_weight_grad") == "torch":
        return grouped_weight_grad_reference(grad_out, x, ends, out_dtype)
    from condmem.ops.grouped_weight_grad.triton import grouped_weight_grad_triton

    return grouped_weight_grad_triton(grad_out, x, ends, out_dtype)


__all__ = ["grouped_weight_grad", "grouped_weight_grad_reference"]
