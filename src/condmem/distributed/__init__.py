"""Tensor-parallel Engram on `torch.distributed` (NCCL on GPUs, gloo on CPU).

* `ShardPlan`: which whole columns (hash heads of every order) and which contiguous rows of
  one layer's table each rank owns, balanced by rows.
* `ShardedRows`: a rank's lookups of its shard and the collective that gives every rank the
  rows it needs: ``head`` (all-gather its columns) or ``row`` (zero-fill the rest and
  all-reduce), optionally sequence-parallel (all-to-all / reduce-scatter over tokens).
* `column_parallel_engram`: the layer with `wkv` split by input columns (all-reduce of the
  keys and value instead of the rows).
* `ShardedTable`: a trainable table sharded over data-parallel ranks (ids and rows, then
  gradients, by all-to-all; each rank's optimizer state for its shard only).
* `node_shared_table`: one host copy of a table per node, written once and mapped
  read-only by the other local ranks.
* `traffic_per_token`: the bytes each mode moves per token.
* `shard_backbone`: a decoder's attention heads and SwiGLU units split over the group for
  tensor-parallel serving (one all-reduce after the output and down projections).
"""

from condmem.distributed.node_table import NodeTableError, map_shared_table, node_shared_table, remove_node_table
from condmem.distributed.sharded_table import ShardedTable
from condmem.distributed.sharding import ShardPlan, ShardingError, traffic_per_token
from condmem.distributed.tp import ShardedRows, column_parallel_engram
from condmem.distributed.tp_backbone import BackboneSlices, backbone_slices, shard_backbone

__all__ = [
    "BackboneSlices",
    "NodeTableError",
    "ShardPlan",
    "ShardedRows",
    "ShardedTable",
    "ShardingError",
    "backbone_slices",
    "column_parallel_engram",
    "map_shared_table",
    "node_shared_table",
    "remove_node_table",
    "shard_backbone",
    "traffic_per_token",
]
