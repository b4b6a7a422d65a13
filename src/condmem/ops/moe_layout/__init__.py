"""Where each (token, expert) pair of a MoE layer goes in its expert-sorted buffer, and back.

`expert_layout(experts, starts, num_rows)` takes the pairs' experts (int64 [P]) and the row where
each expert's group begins, and returns ``dest`` (int64 [P]: each pair's row; the pairs of one
expert fill its group from the start, in pair order) and ``src`` (int64 [num_rows]: the pair each
row holds, ``P`` for a row no pair fills). Both are exact permutations: the kernel and the
reference give the same integers.

On CUDA, a counting sort in Triton (`triton.py`: two passes over blocks of pairs and one scan
between them, each pair's row and each row's pair written directly), registered as an op that
`torch.compile` keeps inside its graph; no sort, and no index_put, which deterministic mode would
sort as well. Elsewhere, the reference (`reference.py`): a stable sort, its ranks written back to
the pairs by an index_put, and a search over the sorted rows for the inverse.
"""

from __future__ import annotations

import torch

from condmem.ops.moe_layout.reference import expert_layout_reference
from condmem.ops.triton_util import resolve_backend


def expert_layout(
    experts: torch.Tensor, starts: torch.Tensor, num_rows: int, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dest, src) of the pairs `experts` (int64 [P], every id < ``len(starts)``) in a buffer of
    `num_rows` rows whose group e begins at ``starts[e]`` (int64 [E]); `backend`: see
    `triton_util.resolve_backend`."""
    if resolve_backend(backend, experts.device, "expert_layout") == "torch":
        return expert_layout_reference(experts, starts, num_rows)
    from condmem.ops.moe_layout.triton import expert_layout_triton

    return expert_layout_triton(experts, starts, num_rows)


__all__ = ["expert_layout", "expert_layout_reference"]
