"""RMSNorm (after an optional residual add) and silu(a) * b in plain torch: the numerics of
`condmem.models.layers.RMSNorm` and ``F.silu(a) * b``, what the Triton kernels are held to."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``RMSNorm(x + residual)``; with a residual returns (x + residual, normed), else normed."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight.to(x.dtype)
    return normed if residual is None else (x, normed)


def silu_mul_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.silu(a) * b
