"""A trainable Engram table sharded over data-parallel ranks: ids and rows by all-to-all.

Each rank trains on its own batch (data parallel), but holds only its columns' rows of the
table (`ShardPlan`) and their optimizer state: a table, its Adam moments and its gradients
cost 1/world per rank. Forward: every rank sends each owner the ids of the owner's columns
(all-to-all), owners gather those rows from their shard and send them back (all-to-all).
Backward: the row gradients go back to their owners the same way (all-to-all), which turn
them into a sparse gradient of their shard (every row counted as often as it was read),
scaled by 1/world so that it is the mean over ranks, as DDP averages the backbone's.

All ranks must pass row ids of the same shape (the exchange sizes are then known without
asking). The rows equal a full table's exactly; after training steps the shards equal
single-process training of the whole table on the concatenated batches up to the order of
the gradient sums (fp32 tolerance).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from condmem.distributed.collectives import all_to_all_equal
from condmem.distributed.sharding import ShardingError, ShardPlan


def _width(plan: ShardPlan, q: int) -> int:
    c0, c1 = plan.columns(q)
    return c1 - c0


class _Exchange(torch.autograd.Function):
    """Rows of the batch's ids from their owners; gradients back to them. Every message is
    padded to the widest rank's columns (one all-to-all of equal sizes, which every backend has); a rank's real
    entries come first, so padding is dropped by position and never reaches a gradient."""

    @staticmethod
    def forward(ctx, row_ids, weight, plan: ShardPlan, rank: int, group):
        w, d = plan.world_size, weight.shape[1]
        b, t = row_ids.shape[:2]
        size = b * t * plan.max_columns
        requests = []
        for q in range(w):
            c0, c1 = plan.columns(q)
            ids = (row_ids[:, :, c0:c1] - plan.row_range(q)[0]).reshape(-1)
            requests.append(torch.cat([ids, ids.new_zeros(size - ids.numel())]))
        served = all_to_all_equal(requests, group=group)  # served[p]: ids rank p asks of me
        real = b * t * _width(plan, rank)
        served = [ids[:real] for ids in served]
        r0, r1 = plan.row_range(rank)
        for ids in served:  # checked on the CPU (free there); a GPU gather of a bad id raises on its own
            if ids.device.type == "cpu" and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= r1 - r0):
                raise ShardingError(
                    f"rank {rank} was asked for rows outside its shard {r0}..{r1 - 1}: were the row "
                    "ids hashed for another layout?"
                )
        outgoing = [torch.cat([weight[ids], weight.new_zeros(size - ids.numel(), d)]) for ids in served]
        incoming = all_to_all_equal(outgoing, group=group)
        ctx.plan, ctx.rank, ctx.group = plan, rank, group
        ctx.save_for_backward(*served)
        ctx.weight_shape = weight.shape
        parts = [got[: b * t * _width(plan, q)].view(b, t, _width(plan, q), d) for q, got in enumerate(incoming)]
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad_row_vectors):
        plan, group = ctx.plan, ctx.group
        served = ctx.saved_tensors
        w, d = plan.world_size, grad_row_vectors.shape[-1]
        b, t = grad_row_vectors.shape[:2]
        size = b * t * plan.max_columns
        outgoing = []
        for q in range(w):
            c0, c1 = plan.columns(q)
            g = grad_row_vectors[:, :, c0:c1].reshape(-1, d)
            outgoing.append(torch.cat([g, g.new_zeros(size - g.shape[0], d)]))
        incoming = all_to_all_equal(outgoing, group=group)  # incoming[p]: gradients of the rows p read
        ids = torch.cat(served)
        values = torch.cat([g[: served[p].numel()] for p, g in enumerate(incoming)]) / w
        grad = torch.sparse_coo_tensor(ids[None], values, ctx.weight_shape, check_invariants=False).coalesce()
        return None, grad, None, None, None


class ShardedTable(nn.Module):
    """This rank's shard of one Engram layer's table, trainable under data parallelism.

    Args:
        plan: the layer's `ShardPlan` over the group.
        shard: float [rows owned, head_dim] initial rows of this rank (e.g. ``full[r0:r1]``).
        group: the process group (default: the world).

    Forward: global row ids [B, T, C] of this rank's batch -> rows [B, T, C, head_dim].
    ``weight`` gets sparse gradients: train it with `condmem.train.optim.SparseAdam`.
    """

    def __init__(self, plan: ShardPlan, shard: torch.Tensor, group=None):
        super().__init__()
        self.plan, self.group = plan, group
        self.rank = dist.get_rank(group)
        if dist.get_world_size(group) != plan.world_size:
            raise ShardingError(f"the plan is for {plan.world_size} ranks, the group has {dist.get_world_size(group)}")
        r0, r1 = plan.row_range(self.rank)
        if shard.dim() != 2 or shard.shape[0] != r1 - r0:
            raise ShardingError(
                f"rank {self.rank} owns rows {r0}..{r1 - 1} ({r1 - r0:,} rows); its shard has shape "
                f"{tuple(shard.shape)}"
            )
        self.weight = nn.Parameter(shard.detach().clone())

    def forward(self, row_ids: torch.Tensor) -> torch.Tensor:
        if row_ids.dim() != 3 or row_ids.shape[2] != self.plan.n_cols:
            raise ShardingError(f"row_ids must be [B, T, {self.plan.n_cols}], got {tuple(row_ids.shape)}")
        return _Exchange.apply(row_ids, self.weight, self.plan, self.rank, self.group)

    def full_table(self) -> torch.Tensor:
        """Every rank's shard, concatenated (an all-gather: for checks and checkpoints)."""
        shards = [None] * self.plan.world_size
        dist.all_gather_object(shards, self.weight.detach().cpu(), group=self.group)
        return torch.cat(shards)
