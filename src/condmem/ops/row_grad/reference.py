"""Plain torch version of the per-row gradient sum (`row_sums`), the kernel's reference."""

from __future__ import annotations

import torch


def row_sums_reference(grad_rows: torch.Tensor, order: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Row u: fp32 sum of ``grad_rows[order[ends[u-1]:ends[u]]]``, first to last, in
    ``grad_rows``' dtype. Adds one run position at a time across all rows (as many torch
    calls as the longest run), so each row's sum is sequential like the kernel's."""
    k = ends.numel()
    acc = torch.zeros(k, grad_rows.shape[1], dtype=torch.float32, device=grad_rows.device)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    lengths = ends - starts
    longest = int(lengths.max()) if k else 0
    for step in range(longest):
        live = (lengths > step).nonzero().squeeze(1)
        acc[live] += grad_rows[order[starts[live] + step]].float()
    return acc.to(grad_rows.dtype)
