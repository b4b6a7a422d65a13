"""The lookup engine: row ids of one batch -> bf16 row vectors, from any tier, overlappable with compute.

For one batch of row ids [T, n_cols] (one Engram layer):

1. **dedup** on the device (sorted, so the misses below come out sorted, which is what
   makes host reads local: more ids per page, fewer translations);
2. **cache probe** in the HBM `RowCache` (optional; Triton kernels on CUDA): hits are
   copied from HBM into the batch's compact rows (one row per unique id; the plan's row
   map puts the CPU share's rows first);
3. **misses** are served from the store:
   * HBM store: the gather kernel, each row scattered to its compact row;
   * host store: a fraction ``cpu_fraction`` of the misses is gathered by CPU threads
     into a small ring of pinned staging chunks, each sent by DMA (straight into the
     compact rows) while the next is gathered; the rest is read by the GPU zero-copy
     (the gather kernel on the page-locked table). A zero-copy read costs about one
     address translation per 64 KiB region touched, while a CPU thread pays per row; so
     the GPU takes the misses that share a region with another miss and the CPU the lone
     ones (`lookup_plan.split_by_density`); `calibrate` times candidate fractions and
     keeps the fastest;
   * disk store: CPU gather into staging, then DMA;
4. **expand**: the gather kernel reads the compact unique rows with the inverse index
   and writes [T, n_cols, head_dim] bf16, dequantizing fp8 on the way;
5. the misses are **admitted** to the cache when a later lookup starts and finds their
   rows landed (on the plan stream, so in order with every probe: a hit can never read
   a slot being rewritten).

Small batches (decode: up to ``direct_max_ids`` ids) skip all of it: one gather kernel
reads the rows straight from the table (HBM or page-locked host), with no host sync; so do
batches of any size from an HBM table, where the plan saves nothing (no host traffic).

On a GPU, steps 1-3's planning runs on fixed-size padded buffers with no host sync
(`condmem.tables.lookup_plan`), replayed as CUDA graphs for the batch sizes given to
`warm_up` (other sizes launch the same kernels one by one), and lookups are
**pipelined**: `lookup` returns a `LookupHandle` once the plan is queued; a gather thread
waits for its counts, gathers the CPU share and queues its DMAs, while the zero-copy share
runs on a stream of its own; the caller's thread queues the expansion at its next
`wait()`, `done()` or `lookup()`, so the gather thread goes straight on to the next batch.
So while batch i's rows are gathered on the CPU, batches i+1 and i+2 are already
deduplicated and probed, and batch i-1's last chunk is in DMA. `handle.wait()` makes the
caller's stream wait for the rows' event, so layers queued before it overlap with the
fetch. The rows are bit-identical whatever the path and timing (tested against a plain
gather).

Threads: one engine may serve lookups from several threads. Its stateful part (plan slots,
lookups in flight, the cache's admissions, the direct path's pending range checks) runs under
one lock (the cache's, when it has one), so lookups of several threads are planned one at a
time; on a GPU their fetches still overlap, and each handle delivers its own lookup's rows.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch

from condmem import native
from condmem.hashing.id_checks import PendingIdChecks
from condmem.ops.gather import engram_gather
from condmem.tables.lookup_plan import (
    COUNT_NAMES,
    N_COUNTS,
    LookupPlan,
    as_words,
    fill_plan_ids,
    move_rows,
    plan_bucket,
)
from condmem.tables.row_cache import RowCache, row_words
from condmem.tables.staged_transfer import STAGING_CHUNK_ROWS, StagedSender
from condmem.tables.errors import StorageError
from condmem.utils.renamed import renamed_attribute
from condmem.tables.storage import LayerStore

log = logging.getLogger("condmem.tables")

CALIBRATION_FRACTIONS = (0.0, 0.3, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 1.0)
"""`LookupEngine.calibrate`'s default candidate CPU shares: dense where uniform ids have had
their optimum (docs/benchmarks.md)."""

ZERO_COPY_PROGRAMS = 64
"""Cap on the zero-copy gather's grid for host tables (an HBM table's misses use the full grid).
Fewer programs in flight read host rows faster and leave the CPU send more of the host's
memory (`docs/lookup-engine.md` has the measurements); too small a grid leaves PCIe idle."""

REGION_BYTES = 64 << 10
"""The zero-copy translation granule that the CPU/GPU split counts misses by."""

STAGING_RING = 4
"""Pinned staging chunks per engine (4 x 65536 rows of 264 B = 66 MiB)."""

MAX_PLAN_SIZES = 4
"""Plan sizes (buckets) kept at once besides the warmed-up ones; a new size beyond this waits
for the lookups in flight and frees the least recently used one."""


@dataclass(frozen=True)
class LookupConfig:
    """What a user tunes in a `LookupEngine`; the defaults suit a large GPU host (docs/lookup-engine.md)."""

    cpu_fraction: float | Literal["calibrate"] = 0.5
    """Share of a host table's misses gathered by CPU threads (0: all read by the GPU in place;
    1: all by the CPU). ``"calibrate"``: timed on uniform ids when the engine is made, fastest
    kept. Irrelevant for HBM tables (no CPU share) and disk tables (all CPU)."""
    cpu_threads: int | None = None
    """Threads of the CPU gather. None: on a GPU, one fewer than torch's intra-op threads (the
    thread that plans the next lookup needs a core: with every core gathering, its launches
    stretched to several times their length, docs/benchmarks.md)."""
    max_in_flight: int = 3
    """Lookups in flight at once (each holds a plan slot of its size); a further `lookup` waits
    for the oldest one's CPU share. 3: lookup i+1 is planned while i-1 is still being sent."""
    direct_max_ids: int = 8192
    """Batches of at most this many ids (decode steps) read the table in place with one kernel,
    with no dedup, cache or host sync (HBM or page-locked host tables); so does every batch
    from an HBM table (dedup and the CPU/GPU split save host traffic, and it has none).
    0 disables the direct path."""
    staging_chunk_rows: int = STAGING_CHUNK_ROWS
    """Rows per pinned staging chunk of the CPU share (each chunk's DMA overlaps the next one's gather)."""
    graphs: bool = True
    """Replay warmed-up plans as CUDA graphs (False: always kernel by kernel, for debugging)."""

    def __post_init__(self) -> None:
        f = self.cpu_fraction
        if not (f == "calibrate" or (isinstance(f, (int, float)) and 0.0 <= f <= 1.0)):
            raise ValueError(f"LookupConfig.cpu_fraction must be in [0, 1] or 'calibrate', got {f!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"LookupConfig.cpu_threads must be >= 1 (or None), got {self.cpu_threads}")
        if self.max_in_flight < 1:
            raise ValueError(f"LookupConfig.max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.direct_max_ids < 0:
            raise ValueError(f"LookupConfig.direct_max_ids must be >= 0, got {self.direct_max_ids}")
        if self.staging_chunk_rows < 1:
            raise ValueError(f"LookupConfig.staging_chunk_rows must be >= 1, got {self.staging_chunk_rows}")


@dataclass
class LookupStats:
    """What one lookup did."""

    ids: int = 0
    unique: int = 0
    hits: int = 0
    cpu_rows: int = 0
    gpu_rows: int = 0
    seconds: float = 0.0
    """Host seconds from the call until its CPU share was queued."""
    cpu_path: str = ""
    """How the CPU share was read: ``native`` (`condmem.native`: the staged send, or the gather on
    the CPU), ``torch`` (the fallback, slower: docs/lookup-engine.md#native-code), ``store`` (the
    store's own reader: a DRAM cache or O_DIRECT); empty when there was no CPU share."""


class LookupHandle:
    """A lookup in flight. `wait()` returns its row vectors (``row_vectors``), ready on the
    caller's current stream.

    The row vectors are this lookup's own, whatever other threads look up meanwhile; a handle may
    be waited for from any thread (each `wait()` readies them on that thread's current stream)."""

    def __init__(
        self,
        row_vectors: torch.Tensor,
        event,
        future: concurrent.futures.Future | None,
        stats: LookupStats,
        batch: _Batch | None = None,
        settle: Callable[[], None] | None = None,
        home: torch.cuda.Stream | None = None,
    ):
        self.row_vectors = row_vectors
        self.event = event
        self._future = future
        self.stats = stats
        self._batch = batch
        self._settle = settle  # the engine's: queues the expansion on the caller's thread
        self._home = home  # no event: the stream the rows were gathered on (the caller's, then)

    def wait(self) -> torch.Tensor:
        """Row vectors [T, n_cols, head_dim] bf16. Blocks the host only until the CPU share is enqueued."""
        if self._future is not None:
            self._future.result()
            self._future = None
        if self._settle is not None:
            self._settle()
        if self.event is not None:
            stream = torch.cuda.current_stream(self.row_vectors.device)
            stream.wait_event(self.event)
            self.row_vectors.record_stream(stream)  # allocated on the lookup stream, used and freed on this one
            if self._batch is not None:
                self._batch.waited = True  # the caller's stream now waits for it: admitting it is free
        elif self._home is not None:
            stream = torch.cuda.current_stream(self.row_vectors.device)
            if stream != self._home:  # gathered on another stream than the one now reading them
                stream.wait_stream(self._home)
                self.row_vectors.record_stream(stream)
        return self.row_vectors

    rows = renamed_attribute("LookupHandle", "rows", "row_vectors")

    def done(self) -> bool:
        if self._future is not None and not self._future.done():
            return False
        if self._settle is not None:
            self._settle()
        return self.event is None or self.event.query()


def _rows_from_raw(
    ids: torch.Tensor, raw: torch.Tensor, fmt: str, head_dim: int, out: torch.Tensor | None = None, **kernel
) -> torch.Tensor:
    """bf16 rows [..., head_dim] of `ids` from raw rows (bf16 bytes, or interleaved fp8 + scales, dequantized).

    `kernel`: gather kernel options (e.g. ``max_programs``)."""
    if fmt == "bf16":
        return engram_gather(ids, raw.view(torch.bfloat16), out=out, **kernel)
    return engram_gather(ids, raw, head_dim=head_dim, out=out, **kernel)


def locked(method):
    """`method` run under its object's ``_lock`` (`LookupEngine`, `EngramMemory`: one caller at a time)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return run


@dataclass
class _Batch:
    """One lookup on its way through the pipeline (GPU path)."""

    plan: LookupPlan  # its plan slot: dedup, hits, misses, shares (static buffers)
    out: torch.Tensor  # [.., head_dim] bf16 rows for the caller
    shape: tuple  # the row ids' shape
    stats: LookupStats
    start: float
    planned: object = None  # event: plan done and its counts / CPU ids copied to the host
    zero_copy_done: object = None  # event: the GPU share is in `plan.compact`
    ready: object = None  # event: `out` holds the rows (recorded by `_assemble`)
    dma_done: object = None  # event: the CPU share is on the device
    future: concurrent.futures.Future | None = None
    waited: bool = False  # a handle's wait() made the caller's stream wait for `ready`
    failed: bool = False  # ids outside the table, or the send failed: nothing to admit
    expanded: bool = False  # every GPU step queued, `ready` recorded (or failed)


class LookupEngine:
    """Serves one layer's row ids from a `LayerStore`, with an optional HBM cache.

    Lookups are pipelined: `lookup` returns once its GPU-side planning is queued, so the
    next batch's dedup and cache probe run while this one's rows are still being gathered
    on the CPU and copied. Use it as a context manager (or call `close()`): it holds a
    gather thread, pinned staging buffers and plan slots.

    Thread-safe: `lookup`, `flush`, `warm_up`, `calibrate`, `raise_pending` and `close` may be
    called from several threads; they run one at a time under the engine's lock (the cache's
    `RowCache.lock` when there is a cache, so engines sharing a cache never interleave a probe
    and an admission). Each handle delivers its own lookup's rows and may be waited for from
    any thread. On the CPU a lookup runs inside `lookup`, so concurrent lookups of one engine
    take turns. `warm_up` and `calibrate` capture CUDA graphs: call them before other threads
    of the process start lookups (a synchronizing call on any thread spoils a capture).
    `gather_into` keeps no state and takes no lock. An error of an earlier direct lookup
    (ids outside the table) is raised by the next call that checks, whichever thread makes it.

    Args:
        store: the layer's rows (any tier).
        device: where rows are wanted (a CUDA device, or CPU).
        cache: optional `RowCache` on `device` (raw rows of the store's format). A lookup's
            misses are admitted when a later lookup starts and finds them fetched, so
            results never depend on timing; only the hit rate can.
        config: what a user tunes (`LookupConfig`).

    Example::

        with LookupEngine(store, "cuda", config=LookupConfig(cpu_fraction="calibrate")) as engine:
            engine.warm_up([16384 * 24])          # capture the plans of prefill-sized batches
            handle = engine.lookup(row_ids)       # returns at once
            ...                                   # queue other work
            rows = handle.wait()                  # [..., head_dim] bf16 on the current stream
    """

    def __init__(
        self,
        store: LayerStore,
        device: str | torch.device = "cpu",
        *,
        cache: RowCache | None = None,
        config: LookupConfig | None = None,
    ):
        config = config or LookupConfig()
        self.store, self.config = store, config
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cache = cache
        if cache is not None and (cache.row_bytes != store.row_bytes or cache.device != self.device):
            raise ValueError(
                f"cache rows ({cache.row_bytes} B on {cache.device}) do not match the store "
                f"({store.row_bytes} B) and device {self.device}"
            )
        self.on_gpu = self.device.type == "cuda"
        self._cpu_fraction = 0.5 if config.cpu_fraction == "calibrate" else float(config.cpu_fraction)
        self.cpu_threads = config.cpu_threads
        if self.cpu_threads is None and self.on_gpu:
            self.cpu_threads = max(1, torch.get_num_threads() - 1)
        self.max_in_flight = config.max_in_flight
        self.direct_max_ids = config.direct_max_ids
        # A CPU share never exceeds the table's rows: small tables get small pinned buffers.
        self.staging_chunk_rows = min(config.staging_chunk_rows, max(1, store.num_rows))
        self.graphs = config.graphs and self.on_gpu
        self.max_plan_sizes = MAX_PLAN_SIZES
        self._direct_checks = PendingIdChecks(
            StorageError, store.num_rows, "table", noun="row id", hint="were these ids hashed for another layout?"
        )
        if self.on_gpu:
            # High priority everywhere: beside a forward pass, the lookup's few short kernels
            # take the next free SMs instead of queueing behind the forward's.
            self.stream = torch.cuda.Stream(self.device, priority=-1)  # plan: dedup, cache, ids out
            self.zero_copy_stream = torch.cuda.Stream(self.device, priority=-1)  # GPU reads of the misses
            self.copy_stream = torch.cuda.Stream(self.device, priority=-1)  # DMAs of the CPU share
            self.finish_stream = torch.cuda.Stream(self.device, priority=-1)  # assemble, expand
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="condmem-lookup")
        else:
            self.stream = self.zero_copy_stream = self.copy_stream = self.finish_stream = None
            self._pool = None
        # Plan slots, lookups in flight, admissions and pending checks; handles may be waited for
        # from other threads. The cache's lock when there is one: probe -> hit read -> admission.
        self._lock = cache.lock if cache is not None else threading.RLock()
        self._sender: StagedSender | None = None  # made on the first CPU share (pinned ring)
        self._plans: collections.OrderedDict[int, list[LookupPlan]] = collections.OrderedDict()  # by bucket, LRU
        self._plan_next: dict[int, int] = {}
        self._warm: set[int] = set()  # buckets whose plan slots are captured graphs
        self._eager_noted: set[int] = set()
        self._in_flight: collections.deque[_Batch] = collections.deque()  # not yet admitted to the cache
        self._closed = False
        if config.cpu_fraction == "calibrate":
            self.calibrate()

    @property
    def cpu_fraction(self) -> float:
        """Share of a host store's misses gathered by CPU threads (set by `calibrate`, or by hand)."""
        return self._cpu_fraction

    @cpu_fraction.setter
    @locked
    def cpu_fraction(self, fraction: float) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"cpu_fraction must be in [0, 1], got {fraction}")
        if fraction == self._cpu_fraction:
            return
        self._cpu_fraction = fraction
        if self._plans:  # plans of the old split: freed, the warmed-up ones captured again
            self._drop_plans(list(self._plans))
            self._capture(sorted(self._warm))

    def __enter__(self) -> LookupEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def _expand(self, compact: torch.Tensor, inverse: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of the batch from the compact unique rows (the inverse index), dequantized."""
        return _rows_from_raw(inverse, compact, self.store.format, self.store.head_dim, out)

    def _cpu_path(self, native_send: bool) -> str:
        if not self.store.raw_in_place:
            return "store"
        return "native" if native_send or native.available() else "torch"

    def _cpu_share(self, ids_host: torch.Tensor, rows: torch.Tensor, planned, stats: LookupStats) -> torch.cuda.Event:
        """Gather thread: the CPU share gathered on CPU threads and sent chunk by chunk through the
        pinned staging ring, straight into `rows` (the plan's first compact rows), on the copy
        stream; returns the event after the last send."""
        self.copy_stream.wait_event(planned)  # the plan slot's earlier readers are done
        if self._sender is None:
            self._sender = StagedSender(
                self.store.row_bytes, self.device, chunk_rows=self.staging_chunk_rows, ring=STAGING_RING
            )
        self._sender.send(self.store, ids_host, rows, self.copy_stream, self.cpu_threads)
        stats.cpu_path = self._cpu_path(self._sender.uses_native(self.store))
        done = torch.cuda.Event()
        done.record(self.copy_stream)
        return done

    # ------------------------------------------------------------------ the lookup
    @locked
    def lookup(self, row_ids: torch.Tensor, *, in_range: bool = False) -> LookupHandle:
        """Start fetching rows for `row_ids` [..] (int64 on `device`); returns a handle at once.

        `in_range`: the ids are known to lie in the table (an `NgramHasher` of the table's layout made
        them: its rows are an offset plus a residue, in range by construction), so the direct path
        queues no range check of its own (a reduction and a copy to the host per call).
        """
        if row_ids.device != self.device:
            raise ValueError(f"row ids on {row_ids.device}, engine serves {self.device}")
        if self._closed:
            raise RuntimeError("this LookupEngine is closed")
        self._direct_checks.raise_pending()
        start = time.perf_counter()
        stats = LookupStats(ids=row_ids.numel())
        if not self.on_gpu:
            rows = self._lookup_sync(row_ids, stats)
            stats.seconds = time.perf_counter() - start
            return LookupHandle(rows, None, None, stats)
        if row_ids.numel() == 0:
            return LookupHandle(
                torch.empty((*row_ids.shape, self.store.head_dim), dtype=torch.bfloat16, device=self.device),
                None,
                None,
                stats,
            )
        if self._direct(row_ids.numel()):
            return self._lookup_direct(row_ids, stats, in_range)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        row_ids.record_stream(self.stream)
        # Back-pressure: at most max_in_flight lookups (and plan slots) in use.
        while sum(not b.expanded for b in self._in_flight) >= self.max_in_flight:
            self._settle(next(b for b in self._in_flight if not b.expanded))
        with torch.cuda.stream(self.stream):
            self._admit_fetched()
            batch = self._plan(row_ids, stats, start)
        batch.future = self._pool.submit(self._finish, batch)  # done (or failed) once the DMAs are queued
        self._in_flight.append(batch)
        return LookupHandle(batch.out, batch.ready, batch.future, stats, batch, functools.partial(self._settle, batch))

    def _settle(self, batch: _Batch) -> None:
        """Caller's thread: wait until the gather thread is done with `batch`, then queue its
        expansion. Raises nothing: an error stays in the batch's future for `wait()`, and the
        batch is then never admitted."""
        if batch.expanded:
            return
        concurrent.futures.wait([batch.future])
        with self._lock:
            if batch.expanded:  # another waiter queued it
                return
            if batch.future.exception() is not None:
                batch.failed = True
            else:
                self._assemble(batch)
            batch.expanded = True

    def _admit_fetched(self) -> None:
        """Admit to the cache (on the plan stream, so in order with every probe and hit read)
        the misses of earlier lookups whose rows are all queued: at once if they have landed
        or the caller already waits for them, otherwise only once `max_in_flight` lookups
        wait (bounding staleness and memory, at the cost of a short GPU-side wait)."""
        while self._in_flight and self._in_flight[0].future.done():
            batch = self._in_flight[0]
            self._settle(batch)
            if not (batch.waited or batch.ready.query()) and len(self._in_flight) < self.max_in_flight:
                break
            self._admit(self._in_flight.popleft())

    def _admit(self, batch: _Batch) -> None:
        """One finished-enqueueing lookup's misses into the cache, on the plan stream (the current
        one). Also what frees its plan slot: the next plan in it is queued after this wait."""
        self.stream.wait_event(batch.ready)
        if self.cache is not None and not batch.failed:
            batch.plan.admit()

    @locked
    def flush(self) -> None:
        """Wait for every lookup in flight and admit its misses to the cache. Work the caller
        queues afterwards (on its current stream: reading, clearing the cache) follows the admissions."""
        if not self.on_gpu:
            return
        for batch in self._in_flight:
            self._settle(batch)
        with torch.cuda.stream(self.stream):
            while self._in_flight:
                self._admit(self._in_flight.popleft())
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def _direct(self, n: int) -> bool:
        """Whether a lookup of `n` ids takes the direct path: decode-sized batches from a table
        the GPU reads in place, and batches of any size from an HBM table."""
        if self.direct_max_ids == 0 or not self.store.gpu_readable:
            return False
        return n <= self.direct_max_ids or self.store.in_device_memory

    def _lookup_direct(self, row_ids: torch.Tensor, stats: LookupStats, in_range: bool = False) -> LookupHandle:
        """Small batches (decode), and any batch of an HBM table: one gather kernel straight from the table.

        No dedup, no cache, no host sync: a few thousand rows cost one kernel of tens of
        microseconds, far less than the sort and synchronizations of the full path. A page-locked
        host table is read on the engine's stream, beside the caller's work (the read crosses
        PCIe). An HBM table is read on the caller's stream: its gather is short, and a side stream
        would cost more host work a call (stream switches, an event, waits) than it could hide.
        """
        # Ids outside the table read zero rows (the kernel masks them); the range is copied back
        # without waiting and raised by a later wait() or lookup() (`raise_pending`). Graphed
        # decoders (`gather_into`) and ids a hasher of this layout made skip it.
        n_ids = row_ids.numel()
        label = None if in_range else (lambda: f"a direct lookup of {n_ids} ids")  # formatted for an error only
        stats.unique, stats.gpu_rows = -1, n_ids
        if self.store.in_device_memory:
            stream = torch.cuda.current_stream(self.device)
            out = self.gather_into(row_ids)
            if label is not None:
                self._direct_checks.submit_ids(row_ids, label)
            return LookupHandle(out, None, None, stats, settle=self._raise_direct, home=stream)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        row_ids.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            out = self.gather_into(row_ids)
            event = torch.cuda.Event()
            event.record(self.stream)
            if label is not None:
                self._direct_checks.submit_ids(row_ids, label)
        return LookupHandle(out, event, None, stats, settle=self._raise_direct)

    @locked
    def raise_pending(self, block: bool = True) -> None:
        """Raise `StorageError` if an earlier direct (decode-sized) lookup read ids outside the
        table. Those lookups never wait for the GPU; their check lands later and is raised by
        the next `wait()` or `lookup()` once known, or here (``block=True`` waits for it)."""
        self._direct_checks.raise_pending(block=block)

    def _raise_direct(self) -> None:
        """A direct lookup's handle: raise an earlier direct lookup's bad ids once known (no wait)."""
        with self._lock:
            self._direct_checks.raise_pending()

    def gather_into(
        self, row_ids: torch.Tensor, out: torch.Tensor | None = None, *, max_programs: int | None = None
    ) -> torch.Tensor:
        """The direct path on the current stream: rows [..., head_dim] bf16 read from the table in place.

        One kernel, no host work: what a CUDA graph captures (`GraphedDecoder` with a
        memory). Needs a store the GPU can read (HBM or page-locked host memory).
        `max_programs` caps the kernel's grid (fewer SMs held by a fetch that runs beside
        other work).
        """
        if not self.store.gpu_readable:
            raise ValueError(f"a {self.store.tier} store cannot be read by the GPU in place; use lookup()")
        return _rows_from_raw(
            row_ids, self.store.raw, self.store.format, self.store.head_dim, out, max_programs=max_programs
        )

    def _split_fraction(self) -> float:
        """Share of the misses the CPU gathers: what the store fixes (none from HBM, all when the
        GPU cannot read it), all without a GPU, else the engine's split."""
        if not self.on_gpu:
            return 1.0
        if self.store.cpu_share is not None:
            return self.store.cpu_share
        if as_words(self.store.raw) is None:
            return 1.0
        return self.cpu_fraction

    # ------------------------------------------------------------------ plan slots
    @locked
    def warm_up(self, sizes: Iterable[int]) -> None:
        """Capture the plans (and cache admissions) of lookups of these many ids as CUDA graphs.

        Lookups of a warmed-up size replay one graph for their whole plan; other sizes run the
        same kernels one by one (the same rows, each kernel launched from the host).
        Sizes are rounded up to `plan_bucket`s; decode-sized batches (direct path) need no
        plan. Captures happen only here (and again after `calibrate` changes the split),
        after the engine's own lookups are flushed: a capture is spoiled by a synchronizing
        CUDA call on any thread of the process, so call it while no other engine of the
        process has lookups in flight (`EngramMemory.warm_up` does this for all its layers).
        """
        if not self.graphs:
            return
        buckets = {plan_bucket(n) for n in sizes if n > 0 and not self._direct(n)}
        self._drop_plans([])  # idle: nothing in flight, every stream run past
        self._warm |= buckets
        self._capture(sorted(buckets))

    def _capture(self, buckets: list[int]) -> None:
        """Every plan slot of these buckets made and captured (the engine is idle: flushed)."""
        if not buckets:
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            for n in buckets:
                ring = self._plans.setdefault(n, [])
                while len(ring) < self.max_in_flight:
                    ring.append(self._new_plan(n))
                for plan in ring:
                    if not plan.captured:
                        plan.capture()
        self.stream.synchronize()

    def _new_plan(self, n: int) -> LookupPlan:
        return LookupPlan(
            n,
            self.store.row_bytes,
            self.store.num_rows,
            self.device,
            self.cache,
            self._split_fraction(),
            REGION_BYTES,
            pin=self.on_gpu,
        )

    def _drop_plans(self, sizes: list[int]) -> None:
        """Free the plan slots of these sizes, once no lookup uses them: every lookup in flight
        is finished and admitted, and the device has run past it (the slots' memory, graph
        pools included, may be reused by any stream once freed)."""
        self.flush()
        if self.on_gpu:
            self.stream.synchronize()
            self.finish_stream.synchronize()
            self.zero_copy_stream.synchronize()
        for size in sizes:
            self._plans.pop(size, None)
            self._plan_next.pop(size, None)

    def _plan_slot(self, n: int) -> LookupPlan:
        """The next of `max_in_flight` plan slots of size `n` (a bucket). Safe to reuse: when a
        lookup is planned, every lookup `max_in_flight` back has been admitted, and its
        admission (on the plan stream) waited for its rows."""
        ring = self._plans.get(n)
        if ring is None:
            cold = [size for size in self._plans if size not in self._warm]
            if len(cold) >= self.max_plan_sizes:
                self._drop_plans(cold[:1])  # the least recently used size that was not warmed up
            ring = self._plans[n] = []
            if self.graphs and n not in self._eager_noted:
                self._eager_noted.add(n)
                log.info(
                    "lookups of %d ids run their plan kernel by kernel: warm_up() that size for one CUDA graph replay",
                    n,
                )
        else:
            self._plans.move_to_end(n)
        k = self._plan_next.get(n, 0)
        if k == len(ring):
            ring.append(self._new_plan(n))
        self._plan_next[n] = (k + 1) % self.max_in_flight
        return ring[k]

    def _plan(self, row_ids: torch.Tensor, stats: LookupStats, start: float) -> _Batch:
        """Plan stream: the plan (dedup, probe and hits, misses, split, counts and the CPU share's
        ids to the host); the GPU share is queued on its own stream, and when there is no CPU
        share, the assembly too. No host sync."""
        plan = self._plan_slot(plan_bucket(row_ids.numel()))
        fill_plan_ids(plan.ids, row_ids.reshape(-1))
        plan.run()
        out = torch.empty((*row_ids.shape, self.store.head_dim), dtype=torch.bfloat16, device=self.device)
        out.record_stream(self.finish_stream)
        batch = _Batch(
            plan, out, tuple(row_ids.shape), stats, start, planned=torch.cuda.Event(), ready=torch.cuda.Event()
        )
        batch.planned.record(self.stream)
        if plan.gpu_share:
            n = plan.n
            with torch.cuda.stream(self.zero_copy_stream):
                self.zero_copy_stream.wait_event(batch.planned)
                # Each row goes straight to its compact row (one kernel, HBM or zero-copy host);
                # padding (row n, past compact[:n]) reads and stores nothing.
                move_rows(
                    self.store.raw,
                    plan.gpu_ids[:n],
                    plan.compact[:n],
                    plan.gpu_dst[:n],
                    max_programs=None if self.store.in_device_memory else ZERO_COPY_PROGRAMS,
                )
                batch.zero_copy_done = torch.cuda.Event()
                batch.zero_copy_done.record(self.zero_copy_stream)
        if not plan.cpu_share:
            self._assemble(batch)
            batch.expanded = True
        return batch

    def _assemble(self, batch: _Batch, expand: bool = True) -> None:
        """Finish stream: once every share's rows are in `compact`, the rows expanded; records `ready`."""
        plan = batch.plan
        with torch.cuda.stream(self.finish_stream):
            self.finish_stream.wait_event(batch.planned)
            if batch.zero_copy_done is not None:
                self.finish_stream.wait_event(batch.zero_copy_done)
            if batch.dma_done is not None:
                self.finish_stream.wait_event(batch.dma_done)
            if expand:
                rows_index = plan.rows_index[: math.prod(batch.shape)].view(batch.shape)
                self._expand(plan.compact, rows_index, out=batch.out)
            batch.ready.record(self.finish_stream)

    def _finish(self, batch: _Batch) -> None:
        """Gather thread: wait for the plan's counts, check the ids, gather and send the CPU share.
        Errors reach the caller through `batch.future` (the executor's).

        Nothing queued on the GPU waits for this thread to act later: a device-wide
        synchronize (CUDA's loading of a kernel's module on first launch is one) would
        otherwise deadlock against a thread held back by the GIL. The expansion is queued by
        the caller's thread (`_settle`), not by a third Python thread, which would contend for
        the GIL with these two."""
        plan = batch.plan
        with torch.cuda.device(self.device):
            batch.planned.synchronize()  # counts and CPU ids are on the host
            counts = dict(zip(COUNT_NAMES, plan.host[:N_COUNTS].tolist()))
            stats = batch.stats
            stats.unique, stats.hits = counts["n_unique"], counts["n_unique"] - counts["n_miss"]
            stats.cpu_rows, stats.gpu_rows = counts["n_cpu"], counts["n_gpu"]
            if counts["bad"]:
                batch.failed = True
                if plan.cpu_share:
                    self._assemble(batch, expand=False)  # `ready` still orders the slot's reuse
                    batch.expanded = True
                bad = counts["min_id"] if counts["min_id"] < 0 else counts["max_id"]
                raise StorageError(f"row id {bad} outside the table's 0..{self.store.num_rows - 1}")
            if plan.cpu_share and counts["n_cpu"]:
                batch.dma_done = self._cpu_share(
                    plan.host[N_COUNTS : N_COUNTS + counts["n_cpu"]],
                    plan.compact[: counts["n_cpu"]],
                    batch.planned,
                    stats,
                )
        stats.seconds = time.perf_counter() - batch.start

    def _lookup_sync(self, row_ids: torch.Tensor, stats: LookupStats) -> torch.Tensor:
        """The same plan on the CPU (CI, CPU-only inference), synchronously: every miss is
        gathered by the CPU threads straight into the plan's compact rows."""
        plan = self._plan_slot(plan_bucket(row_ids.numel()))
        fill_plan_ids(plan.ids, row_ids.reshape(-1))
        plan.run()
        counts = dict(zip(COUNT_NAMES, plan.host[:N_COUNTS].tolist()))
        stats.unique, stats.hits = counts["n_unique"], counts["n_unique"] - counts["n_miss"]
        stats.cpu_rows = n_cpu = counts["n_cpu"]
        if counts["bad"]:
            bad = counts["min_id"] if counts["min_id"] < 0 else counts["max_id"]
            raise StorageError(f"row id {bad} outside the table's 0..{self.store.num_rows - 1}")
        if n_cpu:  # straight into the plan's first compact rows
            self.store.gather_raw(plan.host[N_COUNTS : N_COUNTS + n_cpu], out=plan.compact[:n_cpu])
            stats.cpu_path = self._cpu_path(False)
        out = self._expand(plan.compact, plan.rows_index[: row_ids.numel()].view(row_ids.shape))
        if self.cache is not None:
            # On the CPU the miss count is known here, so only the misses are admitted (the
            # padded admission does the same work over the whole bucket: ~1.4x slower here).
            k = counts["n_miss"]
            rows = row_words(plan.compact).index_select(0, plan.row_of[plan.miss_pos[:k]]).view(torch.uint8)
            self.cache.admit(plan.miss_ids[:k], rows)
        return out

    # ------------------------------------------------------------------ the split
    def _seconds_pipelined(self, batches: list[torch.Tensor]) -> float:
        """Seconds per lookup of `batches` through `run_pipelined` (a prefetching caller's steady state)."""
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        run_pipelined(self, batches)
        torch.cuda.synchronize(self.device)
        return (time.perf_counter() - t0) / max(1, len(batches))

    @locked
    def calibrate(
        self,
        n_ids: int = 1 << 18,
        candidates: tuple[float, ...] | None = None,
        seed: int = 0,
        sample: list[torch.Tensor] | None = None,
        refine: int = 3,
    ) -> float:
        """Pick `cpu_fraction` for a host store from measurements; returns the chosen fraction.

        Each candidate split is timed on a pipeline of lookups (the CPU gather, its DMAs and
        the zero-copy gather share the PCIe link, the host's memory and the GPU's address
        translation, so rates measured alone do not add up); the `refine` fastest are then
        timed again, in reverse order, and keep their better time; the fastest wins. Why
        twice: the host's memory bandwidth swings within seconds, and one slow pass must not
        decide the split. Warmed-up plan sizes are captured again for the chosen split.

        Args:
            n_ids: ids per batch of the default sample (uniform random ids, cache bypassed).
            candidates: fractions to try (default `CALIBRATION_FRACTIONS`).
            seed: of the default sample.
            sample: the caller's own id batches (e.g. the first batches of real traffic),
                served with the cache: for each candidate the cache is cleared, warmed on the
                first half and the second half is timed. Prefer this when a cache is in use:
                a running zero-copy kernel slows the cache's own kernels, so the best split
                with a cache differs from the uniform one (docs/benchmarks.md).
            refine: how many of the fastest candidates are timed a second time (0: none).
        """
        if self.store.cpu_share is not None or not self.on_gpu or as_words(self.store.raw) is None:
            return self.cpu_fraction
        if sample is None:
            gen = torch.Generator(device="cpu").manual_seed(seed)
            warm = [
                torch.randint(0, self.store.num_rows, (n_ids,), generator=gen).to(self.device)
                for _ in range(self.max_in_flight)
            ]
            timed = [
                torch.randint(0, self.store.num_rows, (n_ids,), generator=gen).to(self.device) for _ in range(4)
            ] * 2
            cache, self.cache = self.cache, None
        else:
            if len(sample) < 2:
                raise ValueError("calibrate(sample=...) needs at least two batches (half warm the cache)")
            half = len(sample) // 2
            warm, timed, cache = sample[:half], sample[half:], self.cache
        warmed = set(self._warm)
        self._drop_plans(list(self._plans))  # plans are remade with the cache in use here
        self.warm_up({ids.numel() for ids in warm + timed})  # timed as it will run: graphs

        def timed_at(f: float) -> float:
            self.cpu_fraction = f  # plans of this split, captured again
            if self.cache is not None:
                self.cache.clear()
            self._seconds_pipelined(warm)  # staging, the split's shapes, the cache
            seconds = self._seconds_pipelined(timed)
            self.flush()
            return seconds

        try:
            first, results = time_candidates(timed_at, candidates or CALIBRATION_FRACTIONS, refine)
        finally:
            self.cache = cache
            self._drop_plans(list(self._plans))
            self._warm = warmed
        self._cpu_fraction = min(results, key=results.get)
        self._capture(sorted(warmed))
        again = {f: t for f, t in results.items() if t < first[f]}
        log.info(
            "lookup split calibrated on %s: %s -> cpu_fraction %.2f%s",
            "the caller's sample" if sample is not None else f"{n_ids} random ids",
            ", ".join(f"{f:.2f}: {t * 1e3:.2f} ms" for f, t in first.items()),
            self.cpu_fraction,
            (" (faster when timed again: " + ", ".join(f"{f:.2f}: {t * 1e3:.2f} ms" for f, t in again.items()) + ")")
            if again
            else "",
        )
        self.calibration = results
        return self.cpu_fraction

    @locked
    def close(self) -> None:
        """Finish the lookups in flight, stop the gather thread, free the plan slots and staging."""
        self._closed = True
        if self._pool is not None:
            self._drop_plans(list(self._plans))
            self._pool.shutdown(wait=True)
            self._pool = None
        self._plans.clear()
        self._sender = None


def run_pipelined(engine: LookupEngine, batches: list[torch.Tensor], depth: int | None = None) -> list[LookupHandle]:
    """Look up `batches` back to back, each waited for only `depth` lookups later (default the
    engine's `max_in_flight`), as a prefetching caller would; returns the handles, all waited for.

    The rows are consumed on a stream of their own: waits queued on the stream the ids come
    from would hold back the next lookup's plan (it waits for that stream)."""
    depth = depth or engine.max_in_flight
    consumer = torch.cuda.Stream(engine.device) if engine.on_gpu else None
    handles, waiting = [], collections.deque()

    def wait_oldest() -> None:
        with torch.cuda.stream(consumer) if consumer is not None else contextlib.nullcontext():
            waiting.popleft().wait()

    for ids in batches:
        handles.append(engine.lookup(ids))
        waiting.append(handles[-1])
        if len(waiting) >= depth:
            wait_oldest()
    while waiting:
        wait_oldest()
    return handles


def time_candidates(
    time_at: Callable[[float], float], candidates: tuple[float, ...], refine: int
) -> tuple[dict[float, float], dict[float, float]]:
    """`time_at` of every candidate in turn, then of the `refine` fastest again (the slowest of
    them first); returns the first pass's times and each candidate's best time
    (`LookupEngine.calibrate` keeps the fastest)."""
    first = {f: time_at(f) for f in candidates}
    best = dict(first)
    for f in sorted(first, key=first.get)[: max(0, refine)][::-1]:
        best[f] = min(best[f], time_at(f))
    return first, best
