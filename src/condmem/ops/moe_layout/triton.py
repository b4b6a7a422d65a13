"""Triton kernels of `expert_layout`: a counting sort of the pairs by expert, in two passes over blocks.

`_block_counts`: each program counts its block's pairs per expert (a one-hot [BLOCK, E] summed
down the block). Between the passes, one small scan over the blocks gives each (expert, block)
the row where that block's pairs of the expert begin. `_place`: each program ranks its pairs
among the block's earlier pairs of the same expert (the one-hot's exclusive scan down the block),
writes each pair's row and, at that row, the pair. Rows are unique, so neither write races.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from condmem.ops.launch import FastLaunch

ONE_HOT = 8192
"""Elements of a program's [pairs, experts] one-hot (128 pairs of up to 64 experts): it stays in registers."""


@triton.jit
def _block_counts(experts_ptr, counts_ptr, pairs, n_blocks, n_experts, BLOCK: tl.constexpr, EXPERTS: tl.constexpr):
    b = tl.program_id(0)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(experts_ptr + offs, mask=offs < pairs, other=-1)
    ids = tl.arange(0, EXPERTS)
    hit = (e[:, None] == ids[None, :]).to(tl.int32)
    tl.store(counts_ptr + ids.to(tl.int64) * n_blocks + b, tl.sum(hit, 0), mask=ids < n_experts)


@triton.jit
def _place(experts_ptr, base_ptr, dest_ptr, src_ptr, pairs, n_blocks, BLOCK: tl.constexpr, EXPERTS: tl.constexpr):
    b = tl.program_id(0)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    live = offs < pairs
    e = tl.load(experts_ptr + offs, mask=live, other=-1)
    hit = (e[:, None] == tl.arange(0, EXPERTS)[None, :]).to(tl.int32)
    earlier = tl.cumsum(hit, 0) - hit  # per expert: its pairs before this one in the block
    rank = tl.sum(earlier * hit, 1)
    row = tl.load(base_ptr + e * n_blocks + b, mask=live, other=0) + rank
    tl.store(dest_ptr + offs, row, mask=live)
    tl.store(src_ptr + row, offs.to(tl.int64), mask=live)


def one_hot_shape(n_experts: int) -> tuple[int, int]:
    """(EXPERTS, BLOCK) of the kernels for `n_experts`: the one-hot's width, a power of two, and the
    pairs a program takes, so that the one-hot holds ONE_HOT elements."""
    width = max(16, triton.next_power_of_2(n_experts))
    return width, max(16, ONE_HOT // width)


# Launched at the cost of the launch (`FastLaunch`): once a MoE layer in each forward, on the host's
# path wherever the step is not replayed as a CUDA graph.
_COUNTS, _PLACE = FastLaunch(_block_counts), FastLaunch(_place)


# An opaque op: a compiled graph calls it as eager does. Its kernels have nothing to fuse with their
# neighbours (integer passes over the experts' ids), so Inductor gains nothing from reading them.
@torch.library.custom_op("condmem::expert_layout", mutates_args=())
def expert_layout_triton(
    experts: torch.Tensor, starts: torch.Tensor, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`expert_layout`'s (dest, src) by the kernels: an op that `torch.compile` keeps in its graph, unbroken."""
    pairs, n_experts = experts.numel(), starts.numel()
    dest = torch.empty_like(experts)
    src = torch.full((num_rows,), pairs, dtype=torch.int64, device=experts.device)
    if pairs == 0:
        return dest, src
    width, block = one_hot_shape(n_experts)
    n_blocks = triton.cdiv(pairs, block)
    counts = torch.empty(n_experts, n_blocks, dtype=torch.int32, device=experts.device)
    _COUNTS((n_blocks,), (experts, counts), (pairs, n_blocks, n_experts), (), 4, BLOCK=block, EXPERTS=width)
    base = starts[:, None] + (torch.cumsum(counts, 1, dtype=torch.int64) - counts)  # [E, blocks]
    _PLACE((n_blocks,), (experts, base, dest, src), (pairs, n_blocks), (), 4, BLOCK=block, EXPERTS=width)
    return dest, src


@expert_layout_triton.register_fake
def _(experts: torch.Tensor, starts: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    # the outputs' shapes, for tracing
    return torch.empty_like(experts), experts.new_empty(num_rows)
