"""Plain torch version of the MoE buffer layout (`expert_layout`), the kernel's reference: a stable sort."""

from __future__ import annotations

import torch


def expert_layout_reference(experts: torch.Tensor, starts: torch.Tensor, num_rows: int):
    """(dest, src) of the pairs `experts` (int64 [P], each < len(starts)) in a buffer of `num_rows`
    rows where expert e's group begins at ``starts[e]``: a stable sort by expert, each pair's rank
    among its expert's pairs written back to the pairs (an index_put), then the inverse by a search
    over the sorted rows."""
    pairs = experts.numel()
    order = torch.argsort(experts, stable=True)
    sorted_experts = experts[order]
    ids = torch.arange(starts.numel(), device=experts.device)
    first = torch.searchsorted(sorted_experts, ids)  # each expert's first place in the sort (shapes fixed: traceable)
    rank = torch.arange(pairs, device=experts.device) - first[sorted_experts]
    placed = starts[sorted_experts] + rank  # increasing: by expert, then by rank within its group
    dest = torch.empty_like(experts)
    dest[order] = placed
    row_ids = torch.arange(num_rows, device=experts.device)
    at = torch.searchsorted(placed, row_ids).clamp_max(max(pairs - 1, 0))
    held = placed[at] == row_ids if pairs else torch.zeros_like(row_ids, dtype=torch.bool)
    src = torch.where(held, order[at] if pairs else row_ids, pairs)
    return dest, src
