"""Routed experts: a top-k mixture of SwiGLU experts with a load-balancing loss.

    router: p = softmax(x W_r)                      [N, E], fp32
    choose: the top_k experts of each token, weights g = their p (not renormalized)
    experts: y = sum_j g_j * SwiGLU_{e_j}(x)          (+ the block's shared expert, outside)
    balance: aux = E * sum_i f_i * P_i               f_i: share of the N*top_k choices that
                                                     went to expert i, P_i: mean p_i

The experts run as grouped GEMMs: the N*top_k (token, expert) pairs are sorted by expert
into one buffer in which expert i owns a contiguous slice, padded to a multiple of 8 rows
(at least 8, so no group is empty; the last group runs to the end of the buffer). The
buffer's size, N*top_k rounded up to 8 plus 8*E, does not depend on the routing, so the
layer needs no device-to-host copy. Each GEMM over the slices is either one
`torch._grouped_mm` (CUDA, bf16 under autocast, compute capability 9.0+) or one matmul per
expert over its slice (everywhere else). Padding rows are zeros, are never read back, and
add nothing to any gradient. The combine gathers each pair's row back and sums a token's
top_k rows in a fixed order.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

GROUP_ALIGN = 8
"""Rows of a group are padded to a multiple of this: grouped GEMM kernels need 16-byte
aligned groups in bf16, the weight gradient's contraction runs over them."""


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """``E * sum_i f_i * P_i`` (Switch Transformer, DeepSeekMoE's expert-level balance loss).

    Args:
        probs: fp32 [N, E] router probabilities of N tokens.
        experts: int64 [N, top_k] the experts each token chose.
        n_experts: E.

    Returns a scalar: 1.0 when the choices and the probabilities are uniform, up to E when
    every token goes to one expert with probability 1. Gradients flow through `probs`.
    """
    counts = torch.bincount(experts.flatten(), minlength=n_experts).to(probs.dtype)
    share = counts / max(1, experts.numel())
    return n_experts * (share * probs.mean(0)).sum()


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs the fast kernel for `x`: CUDA, bf16, compute capability >= 9.0."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    )


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, *, use_grouped_mm: bool) -> torch.Tensor:
    """Rows ``ends[i-1]:ends[i]`` of `x` [M, K] times ``weight[i].T`` ([E, N, K], Linear layout) -> [M, N].

    `ends` (int32 [E]) must end at M. `use_grouped_mm`: one `torch._grouped_mm` launch; else
    one matmul per group (which reads `ends` on the host).
    """
    if use_grouped_mm:
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=ends)
    bounds = [0, *ends.tolist()]
    return torch.cat([x[bounds[i] : bounds[i + 1]] @ weight[i].T for i in range(weight.shape[0])])


def dispatch_layout(experts: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each (token, expert) pair goes in the padded expert-sorted buffer.

    Args:
        experts: int64 [N, k] chosen experts.

    Returns (dest int64 [N*k]: each pair's row, pairs in token-major order; ends int32 [E]:
    the end of each expert's rows; rows: the buffer's size, N*k rounded up to GROUP_ALIGN plus
    GROUP_ALIGN*E). Pairs of one expert keep their token order.
    """
    flat = experts.flatten()
    pairs = flat.numel()
    counts = torch.bincount(flat, minlength=n_experts)
    padded = ((counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN).clamp_min(GROUP_ALIGN)
    rows = -(-pairs // GROUP_ALIGN) * GROUP_ALIGN + GROUP_ALIGN * n_experts  # every group end aligned
    ends = torch.cumsum(padded, 0)
    ends[-1] = rows  # the last group takes the unused rows: the groups cover the buffer
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    first_pair = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    rank = torch.arange(pairs, device=flat.device) - first_pair[sorted_experts]
    dest = torch.empty_like(flat)
    dest[order] = starts[sorted_experts] + rank
    return dest, ends.to(torch.int32), rows


class MoE(nn.Module):
    """The routed experts of one block.

    Args:
        dim: width of the residual stream.
        n_experts, top_k, expert_hidden: see `MoEConfig`.

    Parameters: ``router.weight`` [E, dim], ``w13`` [E, 2*hidden, dim] (gate and up
    projections of each expert, in nn.Linear layout), ``w2`` [E, dim, hidden].

    Shapes: x [..., dim] -> [..., dim]. In training mode the forward keeps its
    load-balancing loss in ``aux_loss`` (read by `DecoderLM.aux_loss`).
    """

    def __init__(self, dim: int, n_experts: int, top_k: int, expert_hidden: int, device=None, dtype=None):
        super().__init__()
        self.dim, self.n_experts, self.top_k, self.hidden = dim, n_experts, top_k, expert_hidden
        self.router = nn.Linear(dim, n_experts, bias=False, device=device, dtype=dtype)
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * expert_hidden, dim, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, expert_hidden, device=device, dtype=dtype))
        if self.w13.device.type != "meta":
            nn.init.normal_(self.w13, std=1 / math.sqrt(dim))
            nn.init.normal_(self.w2, std=1 / math.sqrt(expert_hidden))
        self.aux_loss: torch.Tensor | None = None
        self.use_grouped_mm: bool | None = None
        """None: `torch._grouped_mm` where `grouped_mm_available`; True / False forces a backend."""

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router probabilities fp32 [N, E], chosen experts int64 [N, k] and their weights fp32 [N, k].

        The router runs in fp32 even under autocast: a bf16 logit would flip near-tied choices."""
        with torch.autocast(x.device.type, enabled=False):
            probs = torch.softmax(F.linear(x.float(), self.router.weight.float()), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        return probs, experts, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.dim)
        probs, experts, weights = self.route(x)
        self.aux_loss = load_balancing_loss(probs, experts, self.n_experts) if self.training else None
        dest, ends, rows = dispatch_layout(experts, self.n_experts)
        w13, w2 = self.w13, self.w2
        if torch.is_autocast_enabled(x.device.type):
            # Autocast does not cover the grouped GEMM: cast as it would for a Linear.
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
        fast = grouped_mm_available(x) if self.use_grouped_mm is None else self.use_grouped_mm
        pairs = x.unsqueeze(1).expand(-1, self.top_k, -1).reshape(-1, self.dim)
        buffer = x.new_zeros(rows, self.dim).index_copy(0, dest, pairs)
        gate, up = grouped_linear(buffer, w13, ends, use_grouped_mm=fast).chunk(2, dim=-1)
        out = grouped_linear(F.silu(gate) * up, w2, ends, use_grouped_mm=fast)
        routed = out.index_select(0, dest).view(-1, self.top_k, self.dim)
        y = (routed * weights.unsqueeze(-1).to(routed.dtype)).sum(1)
        return y.reshape(shape)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, experts={self.n_experts}, top_k={self.top_k}, hidden={self.hidden}"
