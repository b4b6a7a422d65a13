"""The decode graph's Engram rows staged by CPU threads (`GraphedDecoder(fetch="staged")`).

The zero-copy fetch has the GPU read the host table in place: at tens of GiB its reads are
bound by address translation, and they slow the blocks running beside them
(``benchmarks/results/host_translation_probe_h200.log``). Here the graph's side branch asks
the host instead::

    main stream:  hash ──► embed ─► block 0 ───────────────────────────► [wait l] ─► Engram l ...
    side stream:      └─► ids -> host, request=1 ─► wait done[l]=1 ─► rows -> device (DMA) ─┘
    host threads:                      gather layer l's rows into pinned staging, done[l]=1

The waits and flag writes are the driver's stream memory operations on page-locked host
words (`condmem.native.cudart.stream_memops`): no kernel spins, no SM is held, and the only
GPU reads of host memory are two small DMAs (the ids out, ~24 KB; the rows in, ~0.8 MB at
128 slots) from buffers of a few pages. The host side is `condmem.native.row_server`.

Any store whose raw rows the CPU can read works (page-locked, or memory-mapped from a file:
the CPU takes the page faults). Layers are served in order, each with its own flag, so the
first Engram layer waits only for its own rows. Under tensor parallelism (a memory built with
``process_group=``) each rank's threads stage its own columns' rows from its shard, and the
Engram layer completes them with the memory's collective, as the zero-copy fetch does.
"""

from __future__ import annotations

import os

import torch

from condmem import native
from condmem.native.cudart import stream_memops
from condmem.native.row_server import RowServer, RowServerError
from condmem.ops.gather import engram_gather
from condmem.serving.decode_fetch import SideBranchRows


def default_threads() -> int:
    """Host threads of a staged fetch: 4 (a step's rows staged well within the blocks before the
    Engram layer; more threads shorten it little: docs/benchmarks.md), fewer on a small machine
    (a quarter of its cores): they spin while steps come."""
    return min(4, max(1, (os.cpu_count() or 1) // 4))


def staged_fetch_fits(memory) -> bool:
    """Whether a staged fetch can serve `memory` and should: every table's rows in host memory
    (a GPU reads HBM tables faster in place), no sequence parallelism (the decode graph runs
    every slot on every rank), and the native library and the driver's stream memory
    operations available."""
    if any(sr.sequence_parallel for sr in (memory.sharded or {}).values()):
        return False
    if not native.available() or stream_memops() is None:
        return False
    return all(_cpu_rows(s) is not None for s in memory.stores.values())


def _cpu_rows(store) -> torch.Tensor | None:
    """A store's raw rows when the CPU holds them (host memory or a memory-mapped file), else None."""
    raw = getattr(store, "raw", None)
    return raw if raw is not None and raw.device.type == "cpu" else None


class StagedRows(SideBranchRows):
    """Row ids and rows of every Engram layer in fixed buffers, staged by host threads."""

    def __init__(self, memory, n_slots: int, device, join: str, threads: int | None = None):
        memops = stream_memops()
        if memops is None:
            raise RowServerError(
                "the CUDA driver's stream memory operations (cuStreamWaitValue32) are "
                "unavailable: use the zero-copy fetch"
            )
        super().__init__(memory, device, join)
        self.memops = memops
        widths = {self.columns(lid) for lid in self.layer_ids}
        if len(widths) != 1:
            raise ValueError(f"a staged fetch needs every layer's columns of one width on this rank, got {widths}")
        self.n_cols = widths.pop()
        self.last_replay = torch.cuda.Event()  # recorded after each replay: `close` waits for it
        tables, self.formats = [], []
        for lid in self.layer_ids:
            store = memory.stores[lid]
            raw = _cpu_rows(store)
            if raw is None:
                where = "no in-memory rows" if getattr(store, "raw", None) is None else f"rows on {store.raw.device}"
                raise ValueError(
                    f"Engram layer {lid}'s store ({store.tier}, {where}) cannot be staged by the "
                    "CPU: a staged fetch serves host (or memory-mapped) tables"
                )
            tables.append(raw)
            self.formats.append((store.format, store.head_dim))
        n_ids = n_slots * self.n_cols
        self.server = RowServer(tables, n_ids, threads=threads or default_threads()).start()
        self.ids_dev = torch.zeros(len(self.layer_ids), n_slots, self.n_cols, dtype=torch.long, device=device)
        self.local = torch.arange(n_ids, device=device).view(n_slots, 1, self.n_cols)
        self.raw_dev = {}
        for lid, table, (fmt, head_dim) in zip(self.layer_ids, tables, self.formats):
            vectors = torch.zeros(n_slots, 1, self.n_cols, head_dim, dtype=torch.bfloat16, device=device)
            self.rows_buf[lid] = vectors
            # bf16 raw rows are the row vectors themselves: the DMA lands in place, no kernel after it.
            self.raw_dev[lid] = (
                vectors.view(torch.uint8).view(n_ids, table.shape[1])
                if fmt == "bf16"
                else torch.zeros(n_ids, table.shape[1], dtype=torch.uint8, device=device)
            )

    def _fetch(self, ids_by_layer: dict[int, torch.Tensor]) -> None:
        server, memops = self.server, self.memops
        for i, ids in enumerate(ids_by_layer.values()):
            self.ids_dev[i].copy_(ids[:, 0])
        server.ids.copy_(self.ids_dev.view(len(self.layer_ids), -1), non_blocking=True)
        memops.write(self.side, server.request.data_ptr(), 1)
        for i, lid in enumerate(self.layer_ids):
            done = server.done.data_ptr() + 4 * i
            memops.wait(self.side, done, 1)
            self.raw_dev[lid].copy_(server.staging[i], non_blocking=True)
            memops.write(self.side, done, 0)
            fmt, head_dim = self.formats[i]
            if fmt != "bf16":
                engram_gather(self.local, self.raw_dev[lid], head_dim=head_dim, out=self.rows_buf[lid])  # dequantize
            self.events[lid].record()

    def check(self) -> None:
        """Refuse to go on once the host was asked for ids outside a table (`RowServerError`)."""
        if not self.server.running:
            raise RowServerError("the staged fetch's row server was stopped: the decoder was closed")
        self.server.check()

    def replayed(self) -> None:
        self.last_replay.record()

    def stats(self) -> dict:
        return self.server.stats()

    def close(self) -> None:
        """Stop the host threads, once the GPU has taken every step's rows."""
        if self.server.running:
            # A replay runs its side branch on the graph's own streams, not `self.side`: wait for
            # the last replay itself, or a queued step would wait forever for stopped threads.
            self.last_replay.synchronize()
            self.side.synchronize()
            self.server.stop()

    def __del__(self):  # a graph still queued would wait forever for rows from stopped threads
        try:
            self.close()
        except Exception:
            pass
