"""How one Engram layer's table is split over a tensor-parallel group, and what each mode moves.

A layer's table is the concatenation of its columns' prime-sized bucket ranges (one column
per n-gram order and hash head, `EngramLayout`), so a run of whole columns is a run of
contiguous rows. Rank r owns columns ``col_bounds[r]:col_bounds[r+1]`` and exactly their
rows ``row_bounds[r]:row_bounds[r+1]``; the cuts balance rows (the bytes each rank holds).
Both sharding modes use the same ownership; they differ in what crosses the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from condmem.layout import LayerLayout
from condmem.utils.renamed import renamed_attribute


class ShardingError(ValueError):
    """A layer cannot be split as asked (more ranks than columns, a non-contiguous layout)."""


@dataclass(frozen=True)
class ShardPlan:
    """Column and row ownership of one Engram layer over `world_size` ranks."""

    world_size: int
    col_bounds: tuple[int, ...]
    """Rank r owns columns ``col_bounds[r]:col_bounds[r+1]`` (whole hash heads)."""
    row_bounds: tuple[int, ...]
    """... and table rows ``row_bounds[r]:row_bounds[r+1]`` (exactly those columns' buckets)."""

    @classmethod
    def for_layer(cls, layer: LayerLayout, world_size: int) -> "ShardPlan":
        primes = np.asarray(layer.primes, dtype=np.int64)
        offsets = np.asarray(layer.offsets, dtype=np.int64)
        n_cols = len(primes)
        if not isinstance(world_size, int) or world_size < 1:
            raise ShardingError(f"world_size must be a positive int, got {world_size!r}")
        if world_size > n_cols:
            raise ShardingError(
                f"layer {layer.layer_id} has {n_cols} columns: at most {n_cols} ranks can each own a "
                f"whole one, not {world_size}"
            )
        if not np.array_equal(offsets, np.concatenate([[0], np.cumsum(primes)[:-1]])):
            raise ShardingError(f"layer {layer.layer_id}'s column ranges are not laid out back to back")
        ends = np.cumsum(primes)
        total = int(ends[-1])
        cuts = [0]
        for r in range(1, world_size):
            # The column boundary nearest r/world of the rows, leaving a column for each later rank.
            target = total * r / world_size
            c = int(np.argmin(np.abs(ends - target))) + 1
            cuts.append(min(max(c, cuts[-1] + 1), n_cols - (world_size - r)))
        cuts.append(n_cols)
        row_bounds = [0] + [int(ends[c - 1]) for c in cuts[1:]]
        return cls(world_size, tuple(cuts), tuple(row_bounds))

    @property
    def n_cols(self) -> int:
        return self.col_bounds[-1]

    def columns(self, rank: int) -> tuple[int, int]:
        return self.col_bounds[rank], self.col_bounds[rank + 1]

    def row_range(self, rank: int) -> tuple[int, int]:
        """The table rows rank `rank` owns: ``[start, stop)``."""
        return self.row_bounds[rank], self.row_bounds[rank + 1]

    rows = renamed_attribute("ShardPlan", "rows", "row_range")

    @property
    def max_columns(self) -> int:
        return max(b - a for a, b in zip(self.col_bounds[:-1], self.col_bounds[1:]))


def traffic_per_token(
    n_cols: int,
    head_dim: int,
    world_size: int,
    *,
    hidden: int | None = None,
    hc_mult: int = 1,
    row_bytes: int = 2,
    kv_bytes: int = 4,
) -> dict[str, float]:
    """Bytes each rank sends per token per Engram layer, ring collectives (bandwidth terms only).

    * ``head`` (all-gather of each rank's columns): ``(w-1)/w * C * D * row_bytes``;
    * ``row`` (all-reduce of zero-filled rows): twice that;
    * ``head_sp`` (sequence-parallel, all-to-all: each rank sends its columns of the other
      ranks' tokens): ``(w-1)/w**2 * C * D * row_bytes``;
    * ``row_sp`` (sequence-parallel, reduce-scatter of zero-filled rows over the tokens):
      ``(w-1)/w * C * D * row_bytes``;
    * ``column_wkv`` (rows stay local, the keys and value are all-reduced):
      ``2 (w-1)/w * (hc+1) * hidden * kv_bytes`` (needs `hidden`).
    """
    w = world_size
    vectors = n_cols * head_dim * row_bytes  # one token's row vectors
    share = (w - 1) / w
    out = {
        "head": share * vectors,
        "row": 2 * share * vectors,
        "head_sp": share * vectors / w,
        "row_sp": share * vectors,
    }
    if hidden is not None:
        out["column_wkv"] = 2 * share * (hc_mult + 1) * hidden * kv_bytes
    return out
