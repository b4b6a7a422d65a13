"""Tensor-parallel serving backbone: a `DecoderLM`'s attention heads and SwiGLU units split over a group.

Rank r of w keeps a contiguous run of H/w query heads with their KV/w KV heads (so each
grouped-query pair stays on one rank) and a contiguous run of F/w SwiGLU hidden units. The
q/k/v and gate/up projections are split by output rows, the attention output and down
projections by input columns, so each of those two produces a partial sum that the serving
forward completes with one all-reduce before the residual add (the forward context's
``tp_group``, which the serving steps `decode_step`, `ragged_step`, `prefill_packed` and
`GraphedDecoder` set). Each rank's KV
cache holds its own heads. The embedding, norms, output projection and Engram modules stay
whole on every rank; Engram tables are sharded by `EngramMemory(process_group=...)`.

The dense forward (`DecoderLM.dense_context`: training, `generate`) refuses a sharded model.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from condmem.distributed.sharding import ShardingError
from condmem.models.layers import forget_joined


@dataclasses.dataclass(frozen=True)
class BackboneSlices:
    """What rank `rank` of `world` keeps of every block: query heads, KV heads and SwiGLU units
    as [start, stop) ranges (heads in units of heads, the rest in units of weight rows)."""

    world: int
    rank: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    ffn_units: list[tuple[int, int]]  # per block (widths may differ by block)


def backbone_slices(cfg, world: int, rank: int) -> BackboneSlices:
    """The slices of `rank`; a clear error when the heads or units do not split evenly."""
    if world < 1 or not 0 <= rank < world:
        raise ShardingError(f"rank {rank} of a world of {world}")
    if getattr(cfg, "moe", None) is not None:
        # the routed experts would run whole on every rank and be summed `world` times
        raise ShardingError(
            "this model has routed experts (ModelConfig.moe), which tensor parallelism does not shard: "
            "serve it on one GPU"
        )
    if cfg.n_kv_heads % world:
        raise ShardingError(
            f"{cfg.n_kv_heads} KV heads do not split over {world} ranks: tensor parallelism "
            f"keeps whole KV heads (and their query heads) on one rank"
        )
    q, kv = cfg.n_heads // world, cfg.n_kv_heads // world
    units = []
    for layer in range(cfg.n_layers):
        width = cfg.ffn_width(layer)
        if width % world:
            raise ShardingError(f"block {layer}: {width} SwiGLU units do not split over {world} ranks")
        units.append((rank * width // world, (rank + 1) * width // world))
    return BackboneSlices(world, rank, (rank * q, (rank + 1) * q), (rank * kv, (rank + 1) * kv), units)


def _keep(linear: nn.Linear, outputs: slice | None = None, inputs: slice | None = None) -> None:
    """Replace a linear's weight by a copy of its `outputs` (weight rows) or `inputs` (weight columns)."""
    w = linear.weight.detach()
    w = w[outputs] if outputs is not None else w[:, inputs]
    linear.weight = nn.Parameter(w.clone(), requires_grad=False)
    linear.out_features, linear.in_features = linear.weight.shape


@torch.no_grad()
def shard_backbone(model, group=None):
    """Keep this rank's share of every block of `model` (in place) and mark it as sharded over
    `group` (default: the world), so the serving forward all-reduces each block's two partial
    outputs. Every rank must hold the same model before. Returns the model."""
    if getattr(model, "tp_group", None) is not None:
        raise ShardingError("this model's backbone is already sharded")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    slices = backbone_slices(model.cfg, world, rank)
    for block, units in zip(model.blocks, slices.ffn_units):
        attn, mlp = block.attn, block.mlp
        for module in (attn, mlp):  # a joined weight of the whole block would outlive it
            forget_joined(module)
        hd = attn.head_dim
        q = slice(slices.q_heads[0] * hd, slices.q_heads[1] * hd)
        kv = slice(slices.kv_heads[0] * hd, slices.kv_heads[1] * hd)
        _keep(attn.wq, outputs=q)
        _keep(attn.wk, outputs=kv)
        _keep(attn.wv, outputs=kv)
        _keep(attn.wo, inputs=q)
        attn.n_heads = slices.q_heads[1] - slices.q_heads[0]
        attn.n_kv_heads = slices.kv_heads[1] - slices.kv_heads[0]
        ffn = slice(*units)
        _keep(mlp.w1, outputs=ffn)
        _keep(mlp.w3, outputs=ffn)
        _keep(mlp.w2, inputs=ffn)
    model.tp_group = group if group is not None else dist.group.WORLD
    return model
