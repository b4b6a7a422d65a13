"""The Engram gate: how much of the looked-up value each residual branch lets in.

Per branch m (``hc`` of them), with hidden state ``h_m`` and key ``k_m``::

    g = <RMSNorm(h_m) * q_weight[m], RMSNorm(k_m) * k_weight[m]> / sqrt(D)
    g = sign(g) * sqrt(max(|g|, clamp))
    out_m = sigmoid(g) * v

all in fp32 (the signed square root is steep near zero; bf16 would flip gates).
`engram_gate_reference` is the plain composition the fused kernel (`triton.py`,
forward and backward) is held to; `condmem.ops.gate.engram_gate` picks between them.
"""

from __future__ import annotations

import math

import torch

GATE_CLAMP = 1e-6


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def gate_values(
    hidden: torch.Tensor,
    keys: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float = 1e-6,
    clamp: float = GATE_CLAMP,
) -> torch.Tensor:
    """Sigmoid gate per token and branch, fp32.

    Args:
        hidden: [..., hc, D] residual branches.
        keys: [..., hc, D] one key per branch.
        q_weight, k_weight: [hc, D] RMSNorm weights of the query (hidden) and key.

    Returns:
        fp32 [..., hc] gate values in (0, 1).
    """
    dim = hidden.shape[-1]
    q = _rms_norm(hidden.float(), q_weight.float(), eps)
    k = _rms_norm(keys.float(), k_weight.float(), eps)
    g = (q * k).sum(dim=-1) / math.sqrt(dim)
    g = torch.sign(g) * torch.sqrt(g.abs().clamp_min(clamp))
    return torch.sigmoid(g)


def engram_gate_reference(
    hidden: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float = 1e-6,
    clamp: float = GATE_CLAMP,
    token_mask: torch.Tensor | None = None,
    residual: bool = False,
) -> torch.Tensor:
    """The post-`wkv` part of the Engram module.

    Args:
        hidden: [..., hc, D] residual branches.
        kv: [..., (hc+1)*D] output of the fused `wkv` projection: hc keys, then the value.
        q_weight, k_weight: [hc, D].
        token_mask: optional bool [...]; False closes the gate (output 0) at that token.
        residual: return ``hidden + gate * v`` (added in fp32, rounded once).

    Returns:
        [..., hc, D] gated values (plus `hidden` with `residual`) in `hidden`'s dtype.
    """
    hc, dim = hidden.shape[-2], hidden.shape[-1]
    keys = kv[..., : hc * dim].unflatten(-1, (hc, dim))
    value = kv[..., hc * dim :]
    alpha = gate_values(hidden, keys, q_weight, k_weight, eps, clamp)
    if token_mask is not None:
        alpha = alpha * token_mask[..., None].to(alpha.dtype)
    out = alpha[..., None] * value.float()[..., None, :]
    if residual:
        out = hidden.float() + out
    return out.to(hidden.dtype)
