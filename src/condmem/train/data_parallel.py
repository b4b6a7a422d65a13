"""Data-parallel training with each Engram table sharded over the ranks (`condmem train` under torchrun).

`DataParallelTables` sets up a `DecoderLM` for `torch.distributed` ranks. The backbone is
replicated: the ranks start equal and average their gradients with an all-reduce before
every step, as DDP does, so they stay equal. Each Engram layer's table becomes a
`ShardedTable`, so a rank holds its columns' rows and their `SparseAdam` state only, and
rows and gradients travel by all-to-all. Each rank trains on its slice of the step's batch
(``batch_size / world`` sequences). The global gradient norm adds the replicated backbone's
squares once and the shards' squares over all ranks. Checkpoints: rank 0 writes the
backbone and optimizer as usual, without tables (``tables.safetensors`` is marked
``sharded``). Every rank writes its shards with `save_sharded` into
``run_dir/sharded_tables/layer<id>/step-XXXXXXX/``, and a resume at any world size reads
them with `load_sharded`.

A run equals one process training the whole batch up to the order of the gradient sums
(fp32 tolerance; tested with gloo).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from condmem.distributed import ShardedTable, ShardPlan
from condmem.distributed.checkpoint import load_sharded, save_sharded
from condmem.train.optim import clip_scale, scale_gradients_, squared_norm


class DataParallelTables:
    """The model's Engram tables sharded over the ranks of `group`; the backbone replicated.

    Args:
        model: a `DecoderLM`; its Engram tables are replaced by `ShardedTable`s.
        group: the process group (default: the world).
        shards: {layer id: (rows owned [r1 - r0, D], SparseAdam state or None)} to start from
            (`load`), instead of slicing the model's own tables.
    """

    def __init__(self, model, group=None, shards: dict | None = None):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.tables: dict[int, ShardedTable] = {}
        self.states: dict[int, dict] = {}
        device = model.embed.weight.device
        for engram in model.engram_layers:
            lid = engram.layer_id
            plan = ShardPlan.for_layer(model.layout.layer(lid), self.world)
            if shards is not None:
                rows, state = shards[lid]
                if state is not None:
                    self.states[lid] = state
            else:
                r0, r1 = plan.row_range(self.rank)
                rows = engram.table.weight.detach()[r0:r1]
            table = ShardedTable(plan, rows.to(device), group)
            table.num_embeddings, table.head_dim, table.sparse = plan.row_bounds[-1], rows.shape[1], True
            engram.table = table
            self.tables[lid] = table

    def attach_optimizer(self, sparse) -> None:
        """Give `sparse` (the tables' `SparseAdam`) the state loaded with the shards."""
        for lid, state in self.states.items():
            weight = self.tables[lid].weight
            sparse.state[weight] = {k: (v.to(weight.device) if torch.is_tensor(v) else v) for k, v in state.items()}
        self.states.clear()

    def local(self, batch):
        """This rank's sequences of a step's batch."""
        per = batch.inputs.shape[0] // self.world
        if per * self.world != batch.inputs.shape[0]:
            raise ValueError(f"the batch of {batch.inputs.shape[0]} sequences does not split over {self.world} ranks")
        lo, hi = self.rank * per, (self.rank + 1) * per
        return type(batch)(
            *[
                None if t is None else t[lo:hi]
                for t in (batch.inputs, batch.targets, batch.doc_starts, batch.scored, batch.positions)
            ]
        )

    def average_gradients(self, params) -> None:
        """All-reduce the replicated parameters' gradients to their mean over the ranks."""
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)
                p.grad.div_(self.world)

    @torch.no_grad()
    def clip_(
        self,
        replicated: list[torch.Tensor],
        sharded: list[torch.Tensor],
        max_norm: float,
        adamw: torch.optim.Optimizer | None = None,
    ) -> torch.Tensor:
        """Clip by the global norm: the replicated gradients' squares once, the shards' summed
        over the ranks (sparse ones coalesced). Returns the norm before clipping. `adamw`: see
        `optim.scale_gradients_`."""
        device = self._device(replicated, sharded)

        def squares(grads):
            return squared_norm(grads).to(device) if grads else torch.zeros((), device=device)

        shard_sq = squares(sharded)
        dist.all_reduce(shard_sq, group=self.group)
        total = (squares(replicated) + shard_sq).sqrt()
        if max_norm and max_norm > 0:
            scale_gradients_(replicated + sharded, clip_scale(total, max_norm), adamw)
        return total

    @staticmethod
    def _device(*groups):
        for grads in groups:
            for g in grads:
                return g.device
        return torch.device("cpu")

    def mean(self, value: float, device) -> float:
        """The mean of a number over the ranks."""
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, group=self.group)
        return float(t) / self.world

    # ------------------------------------------------------------------ checkpoints
    @staticmethod
    def layer_dir(run_dir, layer_id: int) -> Path:
        return Path(run_dir) / "sharded_tables" / f"layer{layer_id}"

    def save(self, run_dir, sparse, step: int, fingerprint: str, keep: int = 2) -> None:
        """Every rank writes its shard of every table (with its Adam state); rank 0 then keeps
        the newest `keep` steps of each table."""
        for lid, table in self.tables.items():
            folder = self.layer_dir(run_dir, lid)
            save_sharded(folder, table, sparse, step, fingerprint)
            if self.rank == 0:
                done = sorted(p for p in folder.iterdir() if p.is_dir() and p.name.startswith("step-"))
                for old in done[: max(0, len(done) - max(1, keep))]:
                    shutil.rmtree(old, ignore_errors=True)
        dist.barrier(self.group)

    def broadcast(self, value):
        """Rank 0's `value` on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
        return box[0]

    @classmethod
    def load(cls, run_dir, model, step: int, group=None) -> "DataParallelTables":
        """The shards of every table at `step` for this rank, from a run saved at any world size."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        shards = {}
        for engram in model.engram_layers:
            lid = engram.layer_id
            plan = ShardPlan.for_layer(model.layout.layer(lid), world)
            folder = cls.layer_dir(run_dir, lid) / f"step-{step:07d}"
            weight, state, saved = load_sharded(folder, plan, rank, model.layout.fingerprint)
            shards[lid] = (weight, state)
        return cls(model, group, shards)
