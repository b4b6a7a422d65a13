"""Inference kernels of the serving paths: RMSNorm (optionally after a residual add) and SwiGLU's silu(a) * b.

A decode step of a batch of 128 moves little data per elementwise op, so the launches, not
the bytes, cost: the module composition of an RMSNorm is eight kernels, a residual add and
norm nine. These run as one each, with the numerics of the modules they replace
(`condmem.models.layers.RMSNorm`: fp32 statistics, the normalized value rounded to x's
dtype, then times the weight; `F.silu(a) * b`: silu rounded, then the product). No
autograd: the training forward keeps the modules. CUDA tensors use Triton, others the torch
composition; ``backend=`` forces either.
"""

from __future__ import annotations

import torch

from condmem.ops.norm_act.reference import rms_norm_ref, silu_mul_ref
from condmem.ops.triton_util import resolve_backend


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    backend: str | None = "auto",
):
    """RMSNorm over the last dimension of x [..., D], after ``x + residual`` when given.

    Returns:
        normed [..., D]; with `residual`, (x + residual, normed).
    """
    if resolve_backend(backend, x.device, "rms_norm") == "torch":
        return rms_norm_ref(x, weight, eps, residual)
    from condmem.ops.norm_act import triton as kernels

    return kernels.rms_norm(x, weight, eps, residual)


def silu_mul(a: torch.Tensor, b: torch.Tensor, *, backend: str | None = "auto") -> torch.Tensor:
    """``F.silu(a) * b`` for a, b of one shape and dtype."""
    if resolve_backend(backend, a.device, "silu_mul") == "torch":
        return silu_mul_ref(a, b)
    from condmem.ops.norm_act import triton as kernels

    return kernels.silu_mul(a, b)


__all__ = ["rms_norm", "rms_norm_ref", "silu_mul", "silu_mul_ref"]
