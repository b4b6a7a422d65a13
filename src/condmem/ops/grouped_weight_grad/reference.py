"""Plain torch version of the grouped weight gradient (`grouped_weight_grad`), the kernel's reference."""

from __future__ import annotations

import torch


def grouped_weight_grad_reference(
    grad_out: torch.Tensor, x: torch.Tensor, ends: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[G, N, K]: for each group g, ``grad_out[rows_g].T @ x[rows_g]`` in fp32, where group g holds rows
    ``ends[g-1]:ends[g]`` (``0:ends[0]`` for the first) of `grad_out` [M, N] and `x` [M, K]."""
    if ends.numel() == 0:
        return grad_out.new_zeros(0, grad_out.shape[1], x.shape[1], dtype=out_dtype)
    bounds = [0, *ends.tolist()]
    parts = [
        grad_out[bounds[g] : bounds[g + 1]].float().T @ x[bounds[g] : bounds[g + 1]].float()
        for g in range(ends.numel())
    ]
    return torch.stack(parts).to(out_dtype)
