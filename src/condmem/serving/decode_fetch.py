"""The decode graph's Engram fetch on a side branch: the part both fetches share, and the
zero-copy fetch.

`SideBranchRows` hashes a step's new tokens on the main stream (updating the history), forks a
side stream on which a subclass queues every layer's fetch and records one event per layer,
and gives `decode_step` the `Prepared` interface: ``row_ids(layer)``, and ``row_vectors(layer)``
(its ``rows(layer)``), which makes the main stream wait for that layer's event only (``join="at_layer"``; with
``"before_step"`` the main stream waits for every layer before block 0). Under tensor
parallelism each layer's rows are this rank's columns, completed by the memory's collective on
the main stream.

`ZeroCopyRows` gathers the rows with one kernel per layer that reads the tables in place (HBM,
or page-locked host memory over PCIe). The staged fetch is `condmem.serving.staged_fetch`.
"""

from __future__ import annotations

import torch


class SideBranchRows:
    """A decode step's row ids and rows in fixed buffers, fetched on a side stream.

    Subclasses implement `_fetch(ids_by_layer)`: queue each layer's fetch on the current (side)
    stream into ``rows_buf[layer]`` and record ``events[layer]`` after it, in layer order.
    """

    def __init__(self, memory, device, join: str):
        self.memory, self.join = memory, join
        self.layer_ids = list(memory.layer_ids)
        self.sharded = memory.sharded or {}
        self.side = torch.cuda.Stream(device, priority=-1)  # the fetch is on the critical path
        self.events = {lid: torch.cuda.Event() for lid in self.layer_ids}
        self.rows_buf: dict[int, torch.Tensor] = {}
        self.row_ids_all: torch.Tensor | None = None

    def columns(self, layer_id: int) -> int:
        """Columns of a layer this rank fetches (all of them without tensor parallelism)."""
        sharded = self.sharded.get(layer_id)
        return sharded.local_columns if sharded is not None else self.memory.hasher.layout.n_cols

    def _fetch(self, ids_by_layer: dict[int, torch.Tensor]) -> None:
        raise NotImplementedError

    def launch(self, slots: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor) -> None:
        """Hash the step's tokens (updating history), then queue the fetch on the side stream."""
        memory = self.memory
        self.row_ids_all = memory.hasher.decode(memory.history, slots, ids, valid=valid)[:, None]  # [B, 1, L, C]
        main = torch.cuda.current_stream()
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            ids_by_layer = {}
            for lid in self.layer_ids:
                ids = self.row_ids(lid)
                if lid in self.sharded:
                    ids = self.sharded[lid].local_ids(ids)  # this rank's columns, in its own rows
                ids_by_layer[lid] = ids
            self._fetch(ids_by_layer)
        if self.join == "before_step":
            main.wait_event(self.events[self.layer_ids[-1]])

    # What `GraphedDecoder` calls around each replay and at the end; a fetch with host-side
    # state (the staged fetch's threads) overrides them.
    def check(self) -> None:
        """Before a replay: raise if the fetch cannot serve it."""

    def replayed(self) -> None:
        """After a replay was queued."""

    def stats(self) -> dict | None:
        """Host-side statistics of the fetch, None if it has none."""
        return None

    def close(self) -> None:
        """Release what the fetch holds beyond its buffers."""

    # The interface `decode_step` reads (as from `condmem.serving.Prepared`).
    def row_ids(self, layer_id: int) -> torch.Tensor:
        return self.row_ids_all[:, :, self.memory.hasher.layer_index(layer_id)]

    def row_vectors(self, layer_id: int) -> torch.Tensor:
        return self.rows(layer_id)

    def rows(self, layer_id: int) -> torch.Tensor:
        """A layer's row vectors in ``rows_buf``, once the main stream waits for its fetch (the wait a
        negative-control test removes by replacing this method)."""
        if self.join == "at_layer" or layer_id in self.sharded:
            torch.cuda.current_stream().wait_event(self.events[layer_id])
        if layer_id in self.sharded:
            return self.sharded[layer_id].complete(self.rows_buf[layer_id])
        return self.rows_buf[layer_id]


class ZeroCopyRows(SideBranchRows):
    """Rows gathered in place by one kernel per layer (`EngramMemory.gather_into`); `max_programs`
    caps the kernel's grid (fewer SMs held by a fetch that runs beside other work)."""

    def __init__(self, memory, n_slots: int, device, join: str, max_programs: int | None = None):
        super().__init__(memory, device, join)
        self.max_programs = max_programs
        for lid in self.layer_ids:
            self.rows_buf[lid] = torch.zeros(
                n_slots, 1, self.columns(lid), memory.stores[lid].head_dim, dtype=torch.bfloat16, device=device
            )

    def _fetch(self, ids_by_layer: dict[int, torch.Tensor]) -> None:
        for lid, ids in ids_by_layer.items():
            self.memory.gather_into(lid, ids, out=self.rows_buf[lid], max_programs=self.max_programs)
            self.events[lid].record()
