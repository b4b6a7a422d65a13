"""ShortConv: the causal depthwise convolution the paper adds after the gated value.

``Y = SiLU(Conv1d(RMSNorm(u)))`` per residual branch, depthwise over time with
kernel `kernel_size` and dilation N (so the taps fall one n-gram apart), causal
(left padding only, no position sees its future). The conv weights start at zero,
so a fresh module is exactly the gated value and training decides how much to mix.
The module's caller adds ``Y`` to ``u``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ShortConv(nn.Module):
    """Causal depthwise conv over [B, T, hc, D] with per-branch RMSNorm and SiLU."""

    def __init__(
        self,
        hidden_size: int,
        hc_mult: int,
        kernel_size: int = 4,
        dilation: int = 1,
        eps: float = 1e-6,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.hidden_size = hidden_size
        self.hc_mult = hc_mult
        self.kernel_size = kernel_size
        self.dilation = dilation
        self.eps = eps
        channels = hidden_size * hc_mult
        self.norm_weight = nn.Parameter(torch.ones(hc_mult, hidden_size, device=device, dtype=dtype))
        # [channels, 1, K]: depthwise; zero so the branch starts switched off.
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel_size, device=device, dtype=dtype))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        batch, length, hc, dim = u.shape
        x = u.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight.float()
        x = x.to(u.dtype).reshape(batch, length, hc * dim)
        pad = (self.kernel_size - 1) * self.dilation
        if torch.compiler.is_compiling():
            # The taps as shifted products, which Inductor fuses with the norm and the SiLU (a conv
            # is a library kernel of its own each way, with transposes around it): the same sums,
            # accumulated in fp32 and rounded once, as the conv does.
            w = self.weight.to(x.dtype).float()[:, 0]  # [C, K]: the conv's weights, in fp32
            xp = F.pad(x, (0, 0, pad, 0)).float()
            y = sum(xp[:, k * self.dilation : k * self.dilation + length] * w[:, k] for k in range(self.kernel_size))
            return F.silu(y.to(x.dtype)).view(batch, length, hc, dim)
        y = F.conv1d(
            F.pad(x.transpose(1, 2), (pad, 0)), self.weight.to(x.dtype), dilation=self.dilation, groups=hc * dim
        )
        return F.silu(y).transpose(1, 2).reshape(batch, length, hc, dim)
