"""Backbone building blocks of the reference decoder: RMSNorm, rotary embedding, SwiGLU.

The norm and SwiGLU run either as the modules' own composition (what autograd differentiates)
or, with ``fused=True``, as the inference kernels of `condmem.ops.norm_act` (one launch each,
the same numerics) and one GEMM over projections of the same input (`joined_weight`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from condmem.ops.norm_act import rms_norm, silu_mul


def joined_weight(owner: nn.Module, linears: tuple[nn.Linear, ...]) -> torch.Tensor:
    """One weight for several projections of the same input, their rows stacked, kept by `owner`.

    The linears' weights are made row views of it (the parameters stay the one copy), so an
    inference step runs one GEMM where the modules run several. Joined again when a weight has
    moved or been replaced since (``model.to(...)``, a tensor-parallel shard)."""
    joined = owner.__dict__.get("_joined_weight")
    if joined is not None and joined.shape[0] == sum(m.weight.shape[0] for m in linears):
        start = 0
        for m in linears:
            if m.weight.data_ptr() != joined[start:].data_ptr() or m.weight.dtype != joined.dtype:
                break
            start += m.weight.shape[0]
        else:
            return joined
    with torch.no_grad():
        joined = torch.cat([m.weight.detach() for m in linears])
        start = 0
        for m in linears:
            n = m.weight.shape[0]
            m.weight.data = joined[start : start + n]
            start += n
    owner.__dict__["_joined_weight"] = joined
    return joined


def forget_joined(owner: nn.Module) -> None:
    """Drop `owner`'s joined weight (its parameters were replaced: the old one would outlive them)."""
    owner.__dict__.pop("_joined_weight", None)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and returned in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, *, fused: bool = False) -> torch.Tensor:
        if fused:
            return rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight.to(x.dtype)

    def add_norm(
        self, x: torch.Tensor, update: torch.Tensor, *, fused: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + update, the norm of it); `fused`: one kernel (no autograd)."""
        if fused:
            dim = x.shape[-1]
            total, normed = rms_norm(update.reshape(-1, dim), self.weight, self.eps, residual=x.reshape(-1, dim))
            return total.view(x.shape), normed.view(x.shape)
        x = x + update
        return x, self(x)


class Rotary(nn.Module):
    """RoPE tables for positions 0..max_seq_len-1 (rotate-half convention).

    The tables are buffers, not parameters: they are rebuilt from the config, never saved.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10_000.0, device=None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
        t = torch.arange(max_seq_len, dtype=torch.float64, device=device)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def forward(self, start_pos: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions start_pos..start_pos+length-1: each [length, head_dim/2]."""
        if start_pos + length > self.cos.shape[0]:
            raise ValueError(
                f"positions up to {start_pos + length} exceed max_seq_len={self.cos.shape[0]} of the model"
            )
        return self.cos[start_pos : start_pos + length], self.sin[start_pos : start_pos + length]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [B, H, T, hd] by the angles of cos/sin [T, hd/2] (fp32 maths, x's dtype out)."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.to(x.dtype)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int, device=None, dtype=None):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False, device=device, dtype=dtype)
        self.w3 = nn.Linear(dim, hidden, bias=False, device=device, dtype=dtype)
        self.w2 = nn.Linear(hidden, dim, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = -self.w1.weight.shape[0] % 8 if self.training else 0
        if not pad:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        # A hidden width that is not a multiple of 8 leaves cuBLAS its slowest GEMMs (operands
        # aligned to one element). Zero units padded on add nothing (silu(0) * 0 meets zero
        # columns of w2): the same function, other roundings. In training only, where the batch
        # is large beside the weights' padded copies.
        w1, w3 = (F.pad(m.weight, (0, 0, 0, pad)) for m in (self.w1, self.w3))
        return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), F.pad(self.w2.weight, (0, pad)))

    def add_to(self, x: torch.Tensor, h: torch.Tensor, *, fused: bool = False, reduce=None) -> torch.Tensor:
        """``x + reduce(SwiGLU(h))`` (`reduce`: a tensor-parallel all-reduce of the partial sum).

        `fused` (inference): w1 and w3 as one GEMM, silu(a) * b as one kernel, and without
        `reduce` the residual add riding in the down projection's GEMM (in place on x)."""
        if not fused:
            y = self(h)
            return x + (y if reduce is None else reduce(y))
        dim = h.shape[-1]
        gate_up = F.linear(h.reshape(-1, dim), joined_weight(self, (self.w1, self.w3)))
        hidden = self.w1.weight.shape[0]
        act = silu_mul(gate_up[:, :hidden], gate_up[:, hidden:])
        flat = x.view(-1, dim)
        if reduce is not None:
            down = reduce(F.linear(act, self.w2.weight))
            flat.add_(down)
            return x
        # beta = 1, in place: x is the block's own sum from the fused norm, so no copy of it is
        # made for the GEMM to accumulate into.
        flat.addmm_(act, self.w2.weight.t())
        return x
