"""A rank's share of an Engram layer's lookups, and the collectives that complete them.

Every rank hashes all tokens (cheap, and row ids need the n-gram look-back across any
split of the sequence), looks up only the rows of the columns it owns (`ShardPlan`), from
its own tier (`lookup`: a `LookupEngine`'s, an `EngramMemory` shard's, or a plain gather
of its table slice), then:

* ``head``: all-gathers the columns: every rank ends with all rows of every token, and
  runs the replicated `wkv` and gate (what vLLM does);
* ``row``: writes its rows into a zero-filled [.., C, D] tensor and all-reduces it (what
  SGLang does; twice the bytes, one collective of one shape);
* ``sequence_parallel``: each rank keeps 1/w of the tokens: ``head`` becomes an all-to-all
  (each rank sends its columns of the other ranks' tokens), ``row`` a reduce-scatter.

A sum with zeros is exact, and the gathers move bytes, so the rows are bit-identical to a
single process's. `column_parallel_engram` keeps the rows local and splits `wkv` by its
input columns instead: one all-reduce of the keys and value per token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist

from condmem.distributed.collectives import all_to_all_equal, reduce_scatter_equal
from condmem.distributed.sharding import ShardingError, ShardPlan
from condmem.utils.renamed import renamed_keywords

Mode = Literal["head", "row"]


class ShardedRows:
    """One rank's lookups of one Engram layer under tensor parallelism.

    Args:
        plan: the layer's `ShardPlan` (its world size is the group's).
        lookup: local row ids (int64, any shape, in ``[0, rows owned)``) -> row vectors [..., head_dim].
        head_dim: row width.
        mode: ``head`` (all-gather) or ``row`` (zero-fill + all-reduce).
        sequence_parallel: return only this rank's share of the tokens (axis 1, split in
            ``world_size`` equal chunks, the last padded).
        group: the process group (default: the world).
    """

    def __init__(
        self,
        plan: ShardPlan,
        lookup: Callable[[torch.Tensor], torch.Tensor],
        head_dim: int,
        *,
        mode: Mode = "head",
        sequence_parallel: bool = False,
        group=None,
    ):
        if mode not in ("head", "row"):
            raise ShardingError(f"mode must be 'head' or 'row', got {mode!r}")
        world = dist.get_world_size(group)
        if world != plan.world_size:
            raise ShardingError(f"the plan is for {plan.world_size} ranks, the group has {world}")
        self.plan, self.lookup, self.head_dim = plan, lookup, head_dim
        self.mode, self.sequence_parallel, self.group = mode, sequence_parallel, group
        self.rank = dist.get_rank(group)

    @property
    def local_columns(self) -> int:
        """How many of the layer's columns this rank owns (the width of its `local_ids`)."""
        c0, c1 = self.plan.columns(self.rank)
        return c1 - c0

    def token_chunk(self, n_tokens: int) -> tuple[int, int]:
        """The tokens this rank keeps under sequence parallelism: ``[start, end)`` of axis 1."""
        per = -(-n_tokens // self.plan.world_size)
        return min(self.rank * per, n_tokens), min((self.rank + 1) * per, n_tokens)

    def local_ids(self, row_ids: torch.Tensor) -> torch.Tensor:
        """Global row ids [B, T, C] -> this rank's columns' ids in its own rows: [B, T, C_r]."""
        if row_ids.dim() != 3 or row_ids.shape[2] != self.plan.n_cols:
            raise ShardingError(f"row_ids must be [B, T, {self.plan.n_cols}], got {tuple(row_ids.shape)}")
        c0, c1 = self.plan.columns(self.rank)
        r0, r1 = self.plan.row_range(self.rank)
        ids = row_ids[:, :, c0:c1] - r0
        # Checked here on the CPU only (free there); on a GPU the lookup engine checks its ids
        # without stalling the host.
        if ids.device.type == "cpu" and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= r1 - r0):
            raise ShardingError(
                f"rank {self.rank}: row ids of columns {c0}..{c1 - 1} fall outside its rows "
                f"{r0}..{r1 - 1}: were they hashed for another layout?"
            )
        return ids

    def _local(self, row_ids: torch.Tensor) -> torch.Tensor:
        """This rank's columns' rows of every token: [B, T, C_r, D]."""
        return self.lookup(self.local_ids(row_ids))

    def __call__(self, row_ids: torch.Tensor) -> torch.Tensor:
        """Global row ids [B, T, C] of every token -> rows [B, T, C, D] (sequence-parallel:
        [B, T_r, C, D] for this rank's chunk of the tokens)."""
        return self.complete(self._local(row_ids))

    def complete(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's columns' rows [B, T, C_r, D] -> every rank's rows it needs (see `__call__`)."""
        if self.plan.world_size == 1:
            return local  # one rank owns every column: nothing to exchange
        if self.mode == "row":
            return self._row(local)
        return self._head(local)

    def _padded_columns(self, local: torch.Tensor) -> torch.Tensor:
        extra = self.plan.max_columns - local.shape[2]
        if extra == 0:
            return local.contiguous()
        pad = local.new_zeros((*local.shape[:2], extra, local.shape[3]))
        return torch.cat([local, pad], dim=2)

    def _head(self, local: torch.Tensor) -> torch.Tensor:
        w = self.plan.world_size
        padded = self._padded_columns(local)
        if not self.sequence_parallel:
            parts = [torch.empty_like(padded) for _ in range(w)]
            dist.all_gather(parts, padded, group=self.group)
        else:
            n = local.shape[1]
            per = -(-n // w)
            if per * w != n:
                padded = torch.cat([padded, padded.new_zeros((padded.shape[0], per * w - n, *padded.shape[2:]))], 1)
            parts = all_to_all_equal(list(padded.split(per, dim=1)), group=self.group)
            t0, t1 = self.token_chunk(n)
            parts = [p[:, : t1 - t0] for p in parts]
        widths = [b - a for a, b in zip(self.plan.col_bounds[:-1], self.plan.col_bounds[1:])]
        return torch.cat([p[:, :, :k] for p, k in zip(parts, widths)], dim=2)

    def _row(self, local: torch.Tensor) -> torch.Tensor:
        w = self.plan.world_size
        c0, c1 = self.plan.columns(self.rank)
        full = local.new_zeros((*local.shape[:2], self.plan.n_cols, local.shape[-1]))
        full[:, :, c0:c1] = local
        if not self.sequence_parallel:
            dist.all_reduce(full, group=self.group)
            return full
        n = local.shape[1]
        per = -(-n // w)
        if per * w != n:
            full = torch.cat([full, full.new_zeros((full.shape[0], per * w - n, *full.shape[2:]))], dim=1)
        out = torch.empty_like(full[:, :per])
        reduce_scatter_equal(out, list(full.split(per, dim=1)), group=self.group)
        t0, t1 = self.token_chunk(n)
        return out[:, : t1 - t0]


@renamed_keywords(local_rows="local_row_vectors")
def column_parallel_engram(
    engram,
    hidden: torch.Tensor,
    local_row_vectors: torch.Tensor,
    plan: ShardPlan,
    *,
    token_mask: torch.Tensor | None = None,
    residual: bool = False,
    conv_state: torch.Tensor | None = None,
    group=None,
) -> torch.Tensor:
    """The Engram layer with `wkv` split by its input columns: this rank multiplies its own
    columns' rows by its slice of `wkv` (`Engram.project`), one all-reduce sums the keys and
    value, and the rest of the layer runs replicated (`Engram.forward` from the summed kv).
    Equal to ``engram(hidden, row_vectors=all row vectors)`` up to the order of the sum (fp32 tolerance).

    Args:
        engram: the (replicated) `Engram` module.
        hidden: [B, T, hc, D] or [B, T, D].
        local_row_vectors: this rank's columns' row vectors [B, T, C_r, head_dim] (`ShardedRows._local`);
            ``local_rows=``, its former name, still works for one release (a `DeprecationWarning`).
        token_mask, residual, conv_state: as in `Engram.forward`.
    """
    kv = engram.project(local_row_vectors, columns=plan.columns(dist.get_rank(group)))
    dist.all_reduce(kv, group=group)
    return engram(hidden, token_mask=token_mask, kv=kv, residual=residual, conv_state=conv_state)
