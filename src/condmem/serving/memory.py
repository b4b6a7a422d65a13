"""`EngramMemory`: one model's hasher, decode history and tables, with lookups started before layer 0.

Row ids depend only on token ids, so a forward pass can hash every Engram layer's ids
and start every layer's lookup before the first transformer layer runs::

    prepared = memory.prepare(input_ids)          # hash all layers, start all lookups
    h = embed(input_ids)
    for block in blocks:                          # layers 0..k-1 run while rows arrive
        if block.layer_id in memory.layer_ids:
            vectors = prepared.row_vectors(block.layer_id)  # waits for this layer's rows only
            h = h + block.engram(h, prepared.row_ids(block.layer_id), row_vectors=vectors)
        h = block(h)

Decode keeps the last N-1 compressed ids of each sequence in an `NgramHistory` slot
(`allocate` / `free`, reused across requests); `prepare_decode` hashes one new token per
sequence and updates the history in the same step, padding rows excluded.

Serving engines hand over flat (ragged) batches instead: `prepare_ragged` hashes prefill
chunks, prefix-cache continuations, decode tokens and speculative drafts of many
sequences in one call (``cu_seqlens``), reading and advancing each sequence's history
slot; `commit` advances slots after speculative verification (`docs/engines.md`).

Each layer has its own `LookupEngine` (tier, HBM cache, CPU/zero-copy split), so the
layers' fetches proceed independently; waiting for one never waits for the host.

One memory may serve several threads: its calls that hash, touch the decode history or start
lookups take turns under the memory's lock, and each `Prepared` reads its own batch's rows.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Iterable, Mapping

import torch

from condmem.hashing import NgramHasher
from condmem.tables.lookup import LookupConfig, LookupEngine, LookupHandle, locked
from condmem.tables.row_cache import RowCache
from condmem.tables.storage import LayerStore, place_layer
from condmem.tables.table_file import EngramTableFile, LayerRows
from condmem.utils.device_copy import to_device
from condmem.utils.renamed import renamed_attribute


_UNLOCKED = contextlib.nullcontext()


class EngramMemoryError(ValueError):
    """An EngramMemory is used with inputs or slots it cannot serve."""


@dataclass(frozen=True)
class FetchTiming:
    """How much of one layer's fetch ran behind compute, for one batch."""

    lead_ms: float
    """From the lookups' start to the layer asking for its rows: the compute the fetch could hide behind."""
    stall_ms: float
    """How long the layer then waited for rows that had not arrived."""

    @property
    def hidden(self) -> float:
        """Share of the fetch that ran behind compute: 1 when the rows were there in time, else
        lead / (lead + stall) (the fetch took lead + stall)."""
        total = self.lead_ms + self.stall_ms
        return 1.0 if self.stall_ms <= 0 or total <= 0 else self.lead_ms / total


@dataclass
class Prepared:
    """Row ids of every Engram layer for one batch, and their lookups in flight.

    Its rows are its own batch's, whichever threads prepare other batches of the same memory
    meanwhile; `row_vectors` may be called from any thread."""

    row_ids_all: torch.Tensor
    """int64 [B, T, n_layers, n_cols]."""
    handles: dict[int, LookupHandle]
    layer_index: dict[int, int]
    hasher: NgramHasher | None = None
    complete: dict[int, Callable[[torch.Tensor], torch.Tensor]] | None = None
    """Tensor parallelism: per layer, this rank's rows -> the rows it needs (a collective)."""
    tokens: slice = field(default_factory=lambda: slice(None))
    """Sequence parallelism: the tokens this rank keeps."""
    _row_vectors: dict[int, torch.Tensor] = field(default_factory=dict)
    measured: bool = False
    """`EngramMemory(measure_fetch=True)`: `fetch_timing` can say how much of the fetch was hidden."""
    _started: torch.cuda.Event | None = None
    """Measured on a GPU: a timed event at the lookups' start."""
    _waits: dict[int, tuple] = field(default_factory=dict)
    _lock: object = _UNLOCKED
    """The memory's lock: the hasher's pending checks are shared with threads that hash."""

    def row_ids(self, layer_id: int) -> torch.Tensor:
        """[B, T, n_cols] row ids of one layer (sequence-parallel: this rank's tokens)."""
        return self.row_ids_all[:, self.tokens, self.layer_index[layer_id]]

    def row_vectors(self, layer_id: int, wait: bool = True) -> torch.Tensor:
        """[B, T, n_cols, head_dim] bf16 row vectors of one layer, ready on the current stream.

        `wait=False` hands out the buffer without waiting for the lookup: only for tests
        that prove the handoff matters (the result is then undefined).
        """
        if layer_id not in self.handles:
            raise EngramMemoryError(f"layer {layer_id} has no Engram; Engram layers are {sorted(self.handles)}")
        if not wait:
            return self.handles[layer_id].row_vectors
        if layer_id not in self._row_vectors:
            need = self._mark()
            vectors = self.handles[layer_id].wait()
            if need is not None:
                self._waits[layer_id] = (need, self._mark())
            if self.complete is not None:
                vectors = self.complete[layer_id](vectors)
            self._row_vectors[layer_id] = vectors
            if self.hasher is not None:
                # Ids found out of range by a finished hash are raised here, where the caller waits anyway.
                with self._lock:
                    self.hasher.raise_pending(block=False)
        return self._row_vectors[layer_id]

    rows = renamed_attribute("Prepared", "rows", "row_vectors")

    def _mark(self):
        """A timed event on the current stream when this batch's fetch is measured on a GPU, else None."""
        if self._started is None:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.row_ids_all.device))
        return event

    def fetch_timing(self) -> dict[int, FetchTiming]:
        """Per layer whose rows were read: how much of its fetch was hidden behind compute
        (`EngramMemory(measure_fetch=True)`; waits for the device). On the CPU the lookups run
        inside `prepare`, so nothing is hidden: lead 0, stall the lookup's own time."""
        if not self.measured:
            raise EngramMemoryError("fetch timing needs EngramMemory(measure_fetch=True)")
        if self._started is None:
            return {lid: FetchTiming(0.0, self.handles[lid].stats.seconds * 1e3) for lid in self._row_vectors}
        out = {}
        for lid, (need, got) in self._waits.items():
            got.synchronize()
            out[lid] = FetchTiming(self._started.elapsed_time(need), need.elapsed_time(got))
        return out


@dataclass
class JoinedPrepared:
    """Several `Prepared` flat batches read as one, their tokens in the given order: a step's
    decode tokens prepared when they are known and its prefill chunks prepared a step ahead."""

    parts: list[Prepared]

    def row_ids(self, layer_id: int) -> torch.Tensor:
        return torch.cat([p.row_ids(layer_id) for p in self.parts], dim=1)

    def row_vectors(self, layer_id: int, wait: bool = True) -> torch.Tensor:
        return torch.cat([p.row_vectors(layer_id, wait) for p in self.parts], dim=1)

    rows = renamed_attribute("JoinedPrepared", "rows", "row_vectors")


def join_prepared(parts: list[Prepared]) -> Prepared | JoinedPrepared:
    """`parts` (flat batches from `prepare_ragged`) as one batch, in order."""
    if not parts:
        raise EngramMemoryError("nothing to join")
    return parts[0] if len(parts) == 1 else JoinedPrepared(list(parts))


class EngramMemory:
    """All Engram layers' tables of one model, in any tier, with prefetched lookups.

    Args:
        hasher: the model's `NgramHasher`.
        stores: {layer_id: LayerStore}, one per Engram layer.
        device: where rows are wanted (the model's device).
        cache_bytes: HBM cache per layer in bytes (0: none); only for host/disk stores.
        cpu_fraction: CPU share of host-store misses; None calibrates each host layer.
        max_sequences: decode history slots.
        process_group: tensor parallelism over this `torch.distributed` group: each store holds
            only this rank's shard of its layer (`ShardPlan`; `from_table_file` and
            `from_weights` load only that), and `Prepared.row_vectors` completes the rows with one
            collective (see `condmem.distributed`).
        tp_mode: ``head`` (all-gather) or ``row`` (zero-fill + all-reduce).
        sequence_parallel: each rank keeps 1/world of the tokens (`Prepared.row_ids` / `row_vectors`
            give that chunk).
        measure_fetch: time each batch's fetch against the compute it overlaps
            (`Prepared.fetch_timing`: how much of it was hidden); a few timed CUDA events per layer.

    Thread-safe: one memory may be shared by threads. Its methods that hash, touch the decode
    history or start lookups (`prepare*`, `lookup`, `commit`, `seed`, `allocate`, `free`) and
    `flush`, `calibrate`, `warm_up`, `close` take turns under one lock; on a GPU the lookups they
    start still overlap, and each `Prepared` delivers its own batch's rows to whichever thread
    reads them. A sequence's history slot is one sequence's: two threads must not advance the
    same slot. Call `warm_up` and `calibrate` before other threads of the process start lookups
    (CUDA graph captures); `close()` once the others are done (their later calls raise).
    `gather_into` takes no lock (it keeps no state: what a CUDA graph captures). With several
    threads, an id found out of range by a deferred GPU check is raised by the next call that
    checks, whichever thread makes it.
    """

    def __init__(
        self,
        hasher: NgramHasher,
        stores: Mapping[int, LayerStore],
        device: str | torch.device = "cpu",
        *,
        cache_bytes: int = 0,
        cpu_fraction: float | None = 0.5,
        max_sequences: int = 256,
        process_group=None,
        tp_mode: str = "head",
        sequence_parallel: bool = False,
        measure_fetch: bool = False,
    ):
        missing = set(hasher.layer_ids) - set(stores)
        if missing:
            raise EngramMemoryError(f"no table for Engram layer(s) {sorted(missing)}")
        self.hasher = hasher
        self.device = torch.device(device)
        self.stores = dict(stores)
        self.engines: dict[int, LookupEngine] = {}
        self._closed = False
        self.sharded = None
        if process_group is not None:
            from condmem.distributed import ShardedRows

            self.sharded = {
                lid: ShardedRows(
                    shard_plan(hasher, lid, process_group),
                    None,
                    hasher.layout.config.head_dim,
                    mode=tp_mode,
                    sequence_parallel=sequence_parallel,
                    group=process_group,
                )
                for lid in hasher.layer_ids
            }
        for layer_id in hasher.layer_ids:
            store = self.stores[layer_id]
            expected = hasher.layout.layer(layer_id).num_embeddings
            if self.sharded is not None:
                r0, r1 = self.sharded[layer_id].plan.row_range(self.sharded[layer_id].rank)
                expected = r1 - r0
            if store.num_rows != expected:
                raise EngramMemoryError(
                    f"layer {layer_id}: the table has {store.num_rows:,} rows, the layout "
                    f"{expected:,}{' (this rank' + chr(39) + 's shard)' if self.sharded else ''}"
                )
            cache = None
            if cache_bytes and not store.in_device_memory:
                cache = RowCache.from_bytes(cache_bytes, store.row_bytes, ways=16, device=self.device)
            config = LookupConfig(cpu_fraction="calibrate" if cpu_fraction is None else cpu_fraction)
            self.engines[layer_id] = LookupEngine(store, self.device, cache=cache, config=config)
        self.history = hasher.new_history(max_sequences, self.device)
        # Prompts given on the host are hashed on this stream, beside the caller's queue.
        self.stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        self._layer_index = {lid: i for i, lid in enumerate(hasher.layer_ids)}
        self.measure_fetch = measure_fetch
        self._lock = threading.RLock()  # the hasher, the histories and the engines' lookup starts

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_table_file(
        cls,
        path,
        hasher: NgramHasher,
        tier: str = "host",
        device: str | torch.device = "cpu",
        *,
        tokenizer_fingerprint: str | None = None,
        host_alloc: str = "mmap_register",
        progress: bool = True,
        direct_io: bool = False,
        dram_cache_bytes: int = 0,
        **kwargs,
    ) -> "EngramMemory":
        """Open a table file (identity checked against the hasher's layout) and place each layer in `tier`.

        `direct_io` (disk tier): read rows with O_DIRECT, bypassing the page cache
        (`condmem.tables.direct_read`). `dram_cache_bytes` (disk tier): a bounded DRAM row cache
        of this size per layer in front of the file (`LayerStore.with_dram_cache`).
        """
        if direct_io and tier != "disk":
            raise EngramMemoryError(f"direct_io reads the disk tier; tier is {tier!r}")
        table = EngramTableFile(path, layout=hasher.layout, tokenizer_fingerprint=tokenizer_fingerprint)
        group = kwargs.get("process_group")
        stores = {
            lid: place_layer(
                _shard(table.layer(lid), hasher, lid, group),
                tier,
                device=device if tier == "hbm" else None,
                host_alloc=host_alloc,
                progress=progress,
                name=f"layer {lid}",
                direct_io=direct_io,
                shared_name=_shared_name(table, lid, hasher, group) if host_alloc == "shared" else None,
            )
            for lid in hasher.layer_ids
        }
        if dram_cache_bytes:
            if tier != "disk":
                raise EngramMemoryError(f"a DRAM row cache fronts the disk tier; tier is {tier!r}")
            stores = {lid: store.with_dram_cache(dram_cache_bytes) for lid, store in stores.items()}
        return cls(hasher, stores, device, **kwargs)

    @classmethod
    def from_released(
        cls,
        checkpoint,
        hasher: NgramHasher,
        tier: str = "host",
        device: str | torch.device = "cpu",
        *,
        host_alloc: str = "mmap_register",
        drop_page_cache: bool = True,
        progress: bool = True,
        **kwargs,
    ) -> "EngramMemory":
        """Serve a released DeepSeek-V4.1 checkpoint's tables directly (no conversion step).

        Args:
            checkpoint: a checkpoint folder or safetensors file, or a `ReleasedCheckpoint`.
            hasher: the model's hasher; each table's row count must equal its layout's (the
                sum of the layer's primes), else `TableMismatchError` naming tensor and file.
            tier: ``disk`` serves the fp8 rows where they lie, read with ``pread`` (two reads a
                row: rows and scales); ``host`` copies them once into page-locked host memory as
                interleaved rows (huge pages advised, collapsed where the kernel supports
                ``MADV_COLLAPSE``, coverage logged); ``hbm`` into GPU memory. No tier maps the
                shards: every read checks the scales it returns (a NaN / inf one is an error
                naming tensor and row) and compares each shard's inode, size, mtime and ctime
                with those it had when opened (`condmem.tables.released.FileStamp`), so a shard
                truncated or rewritten under it is an error naming it, never a SIGBUS or new rows.
            drop_page_cache: while copying a layer into host or HBM memory, drop the pages read
                from the page cache (a second copy of the table in DRAM would only crowd out huge
                pages and other processes).
            host_alloc, progress, kwargs: as in `from_table_file`.
        """
        from condmem.tables.released import open_checkpoint

        ckpt = open_checkpoint(checkpoint)
        if ckpt.config is not None:
            _check_same_geometry(ckpt, hasher)
        stores = {}
        for lid in hasher.layer_ids:
            layer_rows = _shard(ckpt.table(lid, hasher.layout), hasher, lid, kwargs.get("process_group"))
            stores[lid] = place_layer(
                layer_rows,
                tier,
                device=device if tier == "hbm" else None,
                host_alloc=host_alloc,
                progress=progress,
                name=f"layer {lid}",
                drop_source_cache=drop_page_cache,
            )
        return cls(hasher, stores, device, **kwargs)

    @classmethod
    def from_weights(
        cls,
        hasher: NgramHasher,
        weights: Mapping[int, torch.Tensor],
        tier: str = "host",
        device: str | torch.device = "cpu",
        *,
        host_alloc: str = "mmap_register",
        progress: bool = False,
        **kwargs,
    ) -> "EngramMemory":
        """Place bf16 table weights (e.g. a trained model's `Engram.table.weight`s) in `tier`."""
        missing = set(hasher.layer_ids) - set(weights)
        if missing:
            raise EngramMemoryError(f"no table for Engram layer(s) {sorted(missing)}")
        stores = {}
        group = kwargs.get("process_group")
        for lid in hasher.layer_ids:
            layer_rows = _shard(LayerRows("bf16", weights[lid].detach()), hasher, lid, group)
            w = layer_rows.weight.to("cpu", torch.bfloat16).contiguous()
            stores[lid] = place_layer(
                LayerRows("bf16", w),
                tier,
                device=device if tier == "hbm" else None,
                host_alloc=host_alloc,
                progress=progress,
                name=f"layer {lid}",
            )
        return cls(hasher, stores, device, **kwargs)

    @property
    def layer_ids(self) -> list[int]:
        return self.hasher.layer_ids

    # ------------------------------------------------------------------ sequences
    @locked
    def allocate(self) -> int:
        """A free decode-history slot for a new sequence."""
        return self.history.allocate()

    @locked
    def free(self, slot: int) -> None:
        """Release a finished sequence's slot (it is reset when reused)."""
        self.history.free(slot)

    # ------------------------------------------------------------------ batches
    def _start(self, row_ids: torch.Tensor, in_range: bool = True) -> Prepared:
        """Every layer's lookup of `row_ids` started; `in_range`: made by this memory's hasher (or one of
        its layout), so the lookups need no range check of their own."""
        started = None
        if self.measure_fetch and self.device.type == "cuda":
            started = torch.cuda.Event(enable_timing=True)
            started.record(torch.cuda.current_stream(self.device))
        prepared = self._start_lookups(row_ids, in_range)
        prepared.measured, prepared._started, prepared._lock = self.measure_fetch, started, self._lock
        return prepared

    def _start_lookups(self, row_ids: torch.Tensor, in_range: bool) -> Prepared:
        if self.sharded is None:
            handles = {
                lid: self.engines[lid].lookup(row_ids[:, :, i], in_range=in_range)
                for lid, i in self._layer_index.items()
            }
            return Prepared(row_ids, handles, self._layer_index, self.hasher)
        handles, complete = {}, {}
        for lid, i in self._layer_index.items():
            sharded = self.sharded[lid]
            handles[lid] = self.engines[lid].lookup(sharded.local_ids(row_ids[:, :, i]))
            complete[lid] = sharded.complete
        tokens = slice(None)
        first = self.sharded[self.hasher.layer_ids[0]]
        if first.sequence_parallel:
            tokens = slice(*first.token_chunk(row_ids.shape[1]))
        return Prepared(row_ids, handles, self._layer_index, self.hasher, complete, tokens)

    @locked
    def lookup(self, row_ids: torch.Tensor, *, in_range: bool = False) -> Prepared:
        """Start every layer's lookup of row ids hashed elsewhere: int64 [B, T, n_layers, n_cols]
        in this memory's layout (e.g. by an adapter that hashes inside a model's forward).

        Ids outside a table are raised by a later wait (decode-sized lookups check without
        waiting for the GPU). `in_range=True` says an `NgramHasher` of this layout made them
        (in range by construction), which spares each layer that check.
        """
        n_layers, n_cols = len(self._layer_index), self.hasher.n_cols
        if (
            not isinstance(row_ids, torch.Tensor)
            or row_ids.dim() != 4
            or tuple(row_ids.shape[2:]) != (n_layers, n_cols)
        ):
            raise EngramMemoryError(
                f"row_ids must be [B, T, {n_layers}, {n_cols}], got {tuple(getattr(row_ids, 'shape', ()))}"
            )
        return self._start(row_ids.to(self.device, non_blocking=True), in_range)

    @locked
    def prepare(
        self,
        input_ids: torch.Tensor,
        *,
        doc_starts: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
    ) -> Prepared:
        """Prefill: hash [B, T] token ids for every layer and start every lookup.

        Ids given on the CPU are range-checked there (no device sync); ids already on the
        device are checked with one sync.

        With `slots` ([B] history slots), the prompts also seed the decode histories
        (`lengths` [B]: real tokens per row when rows are right-padded).
        """
        on_host = input_ids.device.type == "cpu"
        if on_host:
            # Range-check on the host, where the ids are: a check on the device would cost a sync
            # that stalls the host until the GPU has finished everything queued before.
            self.hasher.compress(input_ids, check=True)
        # Host ids on a GPU are copied, hashed and their lookups started on the memory's own
        # stream: nothing there waits for the work already queued on the caller's stream (e.g.
        # the forward of the previous batch), so the lookups start at once and overlap it.
        side = self.stream if on_host else None
        main = torch.cuda.current_stream(self.device) if side is not None else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            ids = input_ids.to(self.device, non_blocking=True)
            starts = None if doc_starts is None else doc_starts.to(self.device, non_blocking=True)
            row_ids = self.hasher(ids, doc_starts=starts, check=not on_host)
            prepared = self._start(row_ids)
        if side is not None:
            main.wait_stream(side)  # the ids and row ids (hashing is short)
            for t in (ids, row_ids) + (() if starts is None else (starts,)):
                t.record_stream(main)
        if slots is not None:
            # On the caller's stream: decode steps queued there may still read and write these slots.
            self.hasher.prefill_history(
                self.history, to_device(slots, self.device), ids, doc_starts=starts, lengths=lengths, check=False
            )
        return prepared

    @locked
    def prepare_ragged(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        *,
        slots: torch.Tensor | None = None,
        lookback_ids: torch.Tensor | None = None,
        blocked: torch.Tensor | None = None,
        commit: bool = True,
    ) -> Prepared:
        """A flat batch of sequence chunks: hash every layer's ids and start every lookup.

        Args:
            input_ids: [n] token ids; sequence b owns ``cu_seqlens[b]:cu_seqlens[b+1]``,
                tokens past ``cu_seqlens[-1]`` are padding (a fixed token budget).
            cu_seqlens: [B+1] boundaries.
            slots: [B] history slot per sequence (-1: none); chunks look back at their
                slot and, with `commit`, advance it by the whole chunk.
            lookback_ids: [B, N-1] token ids before each chunk (oldest first, -1 for none)
                for sequences without a slot (a sequence handed over from elsewhere).
            commit: False for speculative drafts; then call `commit` after verification.

        Returns:
            `Prepared` whose ``row_ids(layer)`` is [1, n, n_cols] and ``rows(layer)``
            [1, n, n_cols, head_dim] (the flat batch as one packed row).
        """
        dev = self.device
        slot_t = None if slots is None else to_device(slots, dev)
        row_ids = self.hasher.hash_ragged(
            to_device(input_ids, dev),
            to_device(cu_seqlens, dev),
            history=self.history if slot_t is not None else None,
            slots=slot_t,
            lookback_ids=None if lookback_ids is None else to_device(lookback_ids, dev),
            blocked=None if blocked is None else to_device(blocked, dev),
            commit=commit,
        )
        return self._start(row_ids[None])

    @locked
    def commit(
        self,
        slots: torch.Tensor,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        n_commit: torch.Tensor,
        *,
        blocked: torch.Tensor | None = None,
    ) -> None:
        """After speculative verification, advance each slot by the first ``n_commit[b]``
        tokens of its chunk (the batch given to ``prepare_ragged(..., commit=False)``)."""
        dev = self.device
        self.hasher.commit(
            self.history,
            to_device(slots, dev),
            to_device(input_ids, dev),
            to_device(cu_seqlens, dev),
            to_device(n_commit, dev),
            blocked=None if blocked is None else to_device(blocked, dev),
        )

    @locked
    def seed(self, slots: torch.Tensor, lookback_ids: torch.Tensor) -> None:
        """A prefix-cache hit: set slots' histories from the token ids before their first
        uncached token ([B, N-1], oldest first, -1 where the sequence has none)."""
        self.hasher.seed_history(self.history, to_device(slots, self.device), to_device(lookback_ids, self.device))

    @locked
    def prepare_decode(
        self, slots: torch.Tensor, input_ids: torch.Tensor, *, valid: torch.Tensor | None = None
    ) -> Prepared:
        """Decode: one new token per sequence ([B] ids, [B] slots; `valid` False marks padding rows)."""
        row_ids = self.hasher.decode(
            self.history,
            to_device(slots, self.device),
            to_device(input_ids, self.device),
            valid=None if valid is None else to_device(valid, self.device),
        )
        return self._start(row_ids[:, None])

    @locked
    def calibrate(
        self, sample_ids: list[torch.Tensor], candidates: tuple[float, ...] | None = None
    ) -> dict[int, float]:
        """Pick each host layer's CPU / zero-copy split on the caller's own token batches.

        `sample_ids`: at least two [B, T] token batches like the traffic to come (half warm
        the HBM cache, half are timed; see `LookupEngine.calibrate`). Better than the
        constructor's uniform-id calibration when a cache is used: the cache's hits change
        which misses are left, and so the best split (docs/benchmarks.md). Returns
        {layer_id: chosen fraction}; tiers other than host keep theirs.
        """
        if len(sample_ids) < 2:
            raise EngramMemoryError(f"calibrate needs at least two token batches, got {len(sample_ids)}")
        row_batches = [self.hasher(ids.to(self.device), check=True) for ids in sample_ids]
        return {
            lid: self.engines[lid].calibrate(sample=[r[:, :, i] for r in row_batches], candidates=candidates)
            for lid, i in self._layer_index.items()
        }

    def gather_into(
        self, layer_id: int, row_ids: torch.Tensor, out: torch.Tensor | None = None, *, max_programs: int | None = None
    ) -> torch.Tensor:
        """Layer `layer_id`'s rows of `row_ids` read in place on the current stream: one kernel, no
        host work, capturable in a CUDA graph (`LookupEngine.gather_into`; HBM or page-locked tables)."""
        return self.engines[layer_id].gather_into(row_ids, out=out, max_programs=max_programs)

    @locked
    def flush(self) -> None:
        """Wait for every layer's lookups in flight (their rows landed, misses admitted to the caches)."""
        for engine in self.engines.values():
            engine.flush()

    @locked
    def warm_up(self, batch_tokens: Iterable[int]) -> None:
        """Capture every layer's lookup plans for batches of these many tokens as CUDA graphs
        (`LookupEngine.warm_up`): call it once before serving with the prefill sizes to come
        (e.g. the scheduler's token budget); other sizes run the same kernels one by one."""
        batch_tokens = [int(t) for t in batch_tokens]
        self.flush()  # no layer's gather thread may sync while another captures
        for lid, engine in self.engines.items():
            # A rank looks up its own columns of each batch's tokens.
            n_cols = self.hasher.n_cols if self.sharded is None else self.sharded[lid].local_columns
            engine.warm_up([t * n_cols for t in batch_tokens])

    @property
    def closed(self) -> bool:
        """`close()` was called: the tables are released and no lookup may start."""
        return self._closed

    @locked
    def close(self) -> None:
        self._closed = True
        for engine in self.engines.values():
            engine.close()
        for store in self.stores.values():
            store.close()


def shard_plan(hasher: NgramHasher, layer_id: int, group):
    """The `ShardPlan` of one layer over `group`."""
    import torch.distributed as dist

    from condmem.distributed import ShardPlan

    return ShardPlan.for_layer(hasher.layout.layer(layer_id), dist.get_world_size(group))


def _shard(layer_rows: LayerRows, hasher: NgramHasher, layer_id: int, group) -> LayerRows:
    """This rank's rows of a layer (a view: a memory-mapped file is read only there), or all of them."""
    if group is None:
        return layer_rows
    import torch.distributed as dist

    r0, r1 = shard_plan(hasher, layer_id, group).row_range(dist.get_rank(group))
    return layer_rows.slice_rows(r0, r1)


def _shared_name(table, layer_id: int, hasher: NgramHasher, group) -> str:
    """The /dev/shm name of one layer's shared host copy: from the file's recorded checksums (its content), format,
    layer and this rank's rows, so that processes share a file only when they serve the same rows."""
    from condmem.tables.host_memory import content_fingerprint, shared_table_name

    record = table.header.metadata.get("integrity")
    if not record:
        raise EngramMemoryError(
            f"{table.path} records no checksums to name a shared host copy by its content: "
            "rewrite it with `condmem convert`, or use another host_alloc"
        )
    row_range = [0, table.num_embeddings[table.layer_ids.index(layer_id)]]
    if group is not None:
        import torch.distributed as dist

        row_range = list(shard_plan(hasher, layer_id, group).row_range(dist.get_rank(group)))
    return shared_table_name(content_fingerprint(record, table.format, layer_id, row_range), layer_id)


def _check_same_geometry(ckpt, hasher: NgramHasher) -> None:
    """Refuse a hasher whose layout is not the one the checkpoint's config describes."""
    from condmem.layout import EngramLayout

    mine = hasher.layout.describe()
    stated = ckpt.config.compressed_vocab_size
    theirs = EngramLayout(ckpt.config, compressed_vocab_size=stated or mine["compressed_vocab_size"]).describe()
    keys = [
        "layer_ids",
        "max_ngram_size",
        "n_heads",
        "table_sizes",
        "pad_id",
        "seed",
        "primes",
        "compressed_vocab_size",
    ]
    diffs = [k for k in keys if theirs[k] != mine[k]]
    if diffs:
        detail = ", ".join(f"{k}: checkpoint {theirs[k]} vs hasher {mine[k]}" for k in diffs[:3])
        raise EngramMemoryError(
            f"the hasher's layout is not the one {ckpt.config_path} describes ({detail}): rows "
            "would be read at the wrong addresses"
        )
