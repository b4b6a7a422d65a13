"""Rows with a patch applied: each row whose id a sorted, unique patch holds takes the patch's
row instead (the rows' own ids in any order, repeats allowed).

The host tier's device Adam reads a step's unique rows from the host and replaces those the
previous step updated (the host has not stored them yet) with the device's own results:
rows, both moments and step counts, all keyed by the same ids. One ``searchsorted`` finds
each id's place in the patch; then one Triton kernel per tensor copies each row from the
patch or from the rows read (`triton.py`, on CUDA or under the interpreter). The torch
reference does the same with gathers and ``torch.where``. Both are copies, so they give the
same bits.
"""

from __future__ import annotations

import torch

from condmem.ops.triton_util import cdiv, next_pow2, resolve_backend

TILE = 4096
"""Elements of a program's [rows, dim] tile (a copy: memory-bound)."""


def patch_positions(ids: torch.Tensor, patch_ids: torch.Tensor) -> torch.Tensor:
    """For each id, the index in the sorted, non-empty `patch_ids` where it would sit (clamped
    into range): the patch row to compare with."""
    return torch.searchsorted(patch_ids, ids).clamp_(max=patch_ids.numel() - 1)


def patched_rows(ids: torch.Tensor, patch_ids: torch.Tensor, pairs, backend: str | None = None) -> list[torch.Tensor]:
    """For each (patch values, values) of `pairs` (leading dimension aligned with the sorted,
    unique `patch_ids` and with `ids`, the same dtype): a new tensor of the values, with the
    patch's row wherever an id is in the patch."""
    for patch, values in pairs:
        if (
            patch.dtype != values.dtype
            or patch.shape[1:] != values.shape[1:]
            or patch.shape[0] != patch_ids.numel()
            or values.shape[0] != ids.numel()
        ):
            raise ValueError(
                f"patched_rows: patch {patch.dtype} {tuple(patch.shape)} for {patch_ids.numel()} patch ids does not "
                f"match values {values.dtype} {tuple(values.shape)} for {ids.numel()} ids"
            )
    if patch_ids.numel() == 0:
        return [values.clone() for _, values in pairs]
    pos = patch_positions(ids, patch_ids)
    if resolve_backend(backend, ids.device, "patched_rows") == "torch":
        hit = patch_ids[pos] == ids
        return [torch.where(hit.view(-1, *([1] * (v.dim() - 1))), p[pos], v) for p, v in pairs]
    return [_patched_triton(ids, patch_ids, pos, patch.contiguous(), values.contiguous()) for patch, values in pairs]


def _patched_triton(ids, patch_ids, pos, patch, values) -> torch.Tensor:
    """One launch of the patch kernel for one tensor of rows (`pos`: `patch_positions`)."""
    from condmem.ops.row_patch.triton import patch_kernel

    k = ids.numel()
    out = torch.empty_like(values)
    dim = values[0].numel() if k else 1
    block_d = next_pow2(max(dim, 1))
    block_r = max(1, TILE // block_d)
    if k:
        patch_kernel[(cdiv(k, block_r),)](
            ids, patch_ids, pos, patch, values, out, k, D=dim, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4
        )
    return out
