"""The Triton kernel of `condmem.ops.row_patch`: each row from the patch or from the rows read."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["k"])
def patch_kernel(
    ids_ptr,
    patch_ids_ptr,
    pos_ptr,
    patch_ptr,
    values_ptr,
    out_ptr,
    k,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[i] = patch[pos[i]] where patch_ids[pos[i]] == ids[i], else values[i]; rows of D elements."""
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    c = tl.arange(0, BLOCK_D)[None, :]
    live = r < k
    pos = tl.load(pos_ptr + r, mask=live, other=0)
    hit = live & (tl.load(patch_ids_ptr + pos, mask=live, other=-1) == tl.load(ids_ptr + r, mask=live, other=0))
    cm = live & (c < D)
    from_patch = tl.load(patch_ptr + pos * D + c, mask=cm & hit, other=0)
    kept = tl.load(values_ptr + r * D + c, mask=cm & ~hit, other=0)
    tl.store(out_ptr + r * D + c, tl.where(hit, from_patch, kept), mask=cm)
