"""Backbone building blocks of the reference decoder: RMSNorm, rotary embedding, SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and returned in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight.to(x.dtype)


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
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
