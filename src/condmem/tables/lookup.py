"""The lookup engine: row ids of one batch -> bf16 rows, from any tier, overlappable with compute.

For one batch of row ids [T, n_cols] (one Engram layer):

1. **dedup** on the device (`torch.unique`: sorted, so the misses below come out sorted,
   which is what makes host reads local: more ids per page, fewer translations);
2. **cache probe** in the HBM `RowCache` (optional): hits are copied from HBM;
3. **misses** are served from the store:
   * HBM store: an index_select;
   * host store: a fraction ``cpu_fraction`` of the misses is gathered by CPU threads
     into a pinned staging buffer and sent in a few DMAs that overlap the gathering;
     the rest is read by the GPU zero-copy (the gather kernel on the page-locked
     table). Zero-copy gathers are translation-bound (~30M rows/s on the H200 whatever
     the row size) while CPU gathers plus DMA are bandwidth-bound, so splitting lets
     both run at once; `calibrate` times candidate splits and keeps the fastest;
   * disk store: CPU gather (page cache) into staging, then DMA;
4. missed rows are **admitted** to the cache;
5. **expand**: the gather kernel reads the compact unique rows with the inverse index
   and writes [T, n_cols, head_dim] bf16, dequantizing fp8 on the way.

Small batches (decode: up to ``direct_max_ids`` ids) skip all of it: one gather kernel
reads the rows straight from the table (HBM or page-locked host), with no host sync.

On a GPU all of it runs on a side stream: `lookup` returns a `LookupHandle` at once
(the CPU share runs in a worker thread), and `handle.wait()` makes the caller's stream
wait for the rows' event, so layers queued before it overlap with the fetch. The rows
are bit-identical whatever the path (tested against a plain gather).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field

import torch

from condmem.ops.gather import engram_gather
from condmem.tables.row_cache import RowCache
from condmem.tables.storage import LayerStore

log = logging.getLogger("condmem.tables")


@dataclass
class LookupStats:
    """What one lookup did."""

    ids: int = 0
    unique: int = 0
    hits: int = 0
    cpu_rows: int = 0
    gpu_rows: int = 0
    seconds: float = 0.0
    marks: list = field(default_factory=list)
    """(step, host seconds since the lookup started), in order: where the host's time went."""

    def mark(self, step: str, start: float) -> None:
        self.marks.append((step, time.perf_counter() - start))


class LookupHandle:
    """A lookup in flight. `wait()` returns the rows, ready on the caller's current stream."""

    def __init__(self, rows: torch.Tensor, event, future: concurrent.futures.Future | None, stats: LookupStats):
        self.rows = rows
        self.event = event
        self._future = future
        self.stats = stats

    def wait(self) -> torch.Tensor:
        """Rows [T, n_cols, head_dim] bf16. Blocks the host only until the CPU share is enqueued."""
        if self._future is not None:
            self._future.result()
            self._future = None
        if self.event is not None:
            stream = torch.cuda.current_stream(self.rows.device)
            stream.wait_event(self.event)
            self.rows.record_stream(stream)   # allocated on the lookup stream, used and freed on this one
        return self.rows

    def done(self) -> bool:
        return (self._future is None or self._future.done()) and (self.event is None or self.event.query())


def _rows_from_raw(ids: torch.Tensor, raw: torch.Tensor, fmt: str, head_dim: int,
                   out: torch.Tensor | None = None, **kernel) -> torch.Tensor:
    """bf16 rows [..., head_dim] of `ids` from raw rows (bf16 bytes, or interleaved fp8 + scales, dequantized).

    `kernel`: gather kernel options (e.g. ``max_programs``)."""
    if fmt == "bf16":
        return engram_gather(ids, raw.view(torch.bfloat16), out=out, **kernel)
    return engram_gather(ids, raw, head_dim=head_dim, out=out, **kernel)


def _as_words(raw: torch.Tensor) -> torch.Tensor | None:
    """Raw uint8 rows viewed as 4- or 2-byte float words, which the gather kernel moves bit for bit
    (a plain load and store, no arithmetic); None when the row size is odd."""
    for dtype, size in ((torch.float32, 4), (torch.float16, 2)):
        if raw.shape[-1] % size == 0:
            return raw.view(dtype)
    return None


class LookupEngine:
    """Serves one layer's row ids from a `LayerStore`, with an optional HBM cache.

    Args:
        store: the layer's rows (any tier).
        device: where rows are wanted (a CUDA device, or CPU).
        cache: optional `RowCache` on `device` (raw rows of the store's format).
        cpu_fraction: share of a host store's misses gathered by CPU threads (0: all
            zero-copy; 1: all CPU). `calibrate()` sets it from measurements.
        cpu_threads: torch intra-op threads used by the CPU gather (default: torch's).
        cpu_chunks: pieces the CPU share is cut into, so each piece's DMA overlaps the
            next piece's gather.
        max_rows: staging capacity (rows per lookup) for the CPU path.
        direct_max_ids: batches of at most this many ids (decode steps) skip dedup, cache
            and the CPU split: one gather kernel reads the table in place (when the GPU can
            read it: HBM or page-locked host). 0 disables.
    """

    def __init__(self, store: LayerStore, device: str | torch.device = "cpu", *, cache: RowCache | None = None,
                 cpu_fraction: float = 0.5, cpu_threads: int | None = None, cpu_chunks: int = 4,
                 max_rows: int = 1 << 20, direct_max_ids: int = 8192):
        self.store = store
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cache = cache
        if cache is not None and (cache.row_bytes != store.row_bytes or cache.device != self.device):
            raise ValueError(f"cache rows ({cache.row_bytes} B on {cache.device}) do not match the store "
                             f"({store.row_bytes} B) and device {self.device}")
        if not 0.0 <= cpu_fraction <= 1.0:
            raise ValueError(f"cpu_fraction must be in [0, 1], got {cpu_fraction}")
        self.cpu_fraction = cpu_fraction
        self.cpu_threads = cpu_threads
        self.cpu_chunks = max(1, cpu_chunks)
        self.direct_max_ids = direct_max_ids
        self.max_rows = max_rows
        self.on_gpu = self.device.type == "cuda"
        if self.on_gpu:
            # High priority: when the lookup runs beside a forward pass, its few short kernels
            # take the next free SMs instead of queueing behind the forward's.
            self.stream = torch.cuda.Stream(self.device, priority=-1)
            # DMAs of the CPU share run on their own stream, beside the zero-copy kernel.
            self.copy_stream = torch.cuda.Stream(self.device, priority=-1)
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="condmem-lookup")
        else:
            self.stream = None
            self._pool = None
        self._staging: torch.Tensor | None = None
        self._staging_free = None   # event: the last DMA out of the staging buffer finished
        self._pending: concurrent.futures.Future | None = None

    # ------------------------------------------------------------------ helpers
    def _staging_rows(self, n: int) -> torch.Tensor:
        if self._staging is None or self._staging.shape[0] < n:
            cap = max(n, min(self.max_rows, 1 << 16))
            self._staging = torch.empty((cap, self.store.row_bytes), dtype=torch.uint8, pin_memory=self.on_gpu)
        return self._staging[:n]

    def _expand(self, compact: torch.Tensor, inverse: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of the batch from the compact unique rows (the inverse index), dequantized."""
        return _rows_from_raw(inverse, compact, self.store.format, self.store.head_dim, out)

    def _cpu_share(self, ids_host: torch.Tensor, stats: LookupStats | None = None, start: float = 0.0) -> torch.Tensor:
        """Gather rows on CPU threads into pinned staging, chunk by chunk, each chunk's DMA
        enqueued on the copy stream as soon as it is gathered (copying overlaps the next
        chunk's gather, and the zero-copy kernel on the lookup stream).

        Returns the rows on the device, ready for work on the lookup stream.
        """
        if self._staging_free is not None:
            self._staging_free.synchronize()   # the previous DMA may still be reading the buffer
        n = ids_host.numel()
        staging = self._staging_rows(n)
        if stats is not None:
            stats.mark("staging ready", start)
        with torch.cuda.stream(self.copy_stream):
            # Allocated from the copy stream's pool (ordered with its own work), used later on the lookup stream.
            on_device = torch.empty((n, self.store.row_bytes), dtype=torch.uint8, device=self.device)
        on_device.record_stream(self.stream)
        chunk = max(1 << 14, -(-n // self.cpu_chunks))
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            self.store.gather_raw(ids_host[s:e], out=staging[s:e], threads=self.cpu_threads)
            if stats is not None:
                stats.mark(f"chunk {s // chunk} gathered", start)
            with torch.cuda.stream(self.copy_stream):
                on_device[s:e].copy_(staging[s:e], non_blocking=True)
        self._staging_free = torch.cuda.Event()
        self._staging_free.record(self.copy_stream)
        self.stream.wait_event(self._staging_free)
        return on_device

    # ------------------------------------------------------------------ the lookup
    def lookup(self, row_ids: torch.Tensor) -> LookupHandle:
        """Start fetching rows for `row_ids` [..] (int64 on `device`); returns a handle at once."""
        if row_ids.device != self.device:
            raise ValueError(f"row ids on {row_ids.device}, engine serves {self.device}")
        start = time.perf_counter()
        stats = LookupStats(ids=row_ids.numel())
        if not self.on_gpu:
            rows = self._lookup_sync(row_ids, stats)
            stats.seconds = time.perf_counter() - start
            return LookupHandle(rows, None, None, stats)
        if self._pending is not None:
            # One lookup at a time per engine: the next probe must see this one's admissions,
            # and stream work must not interleave between the two threads.
            self._pending.result()
            self._pending = None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        row_ids.record_stream(self.stream)
        if row_ids.numel() <= self.direct_max_ids and self.store.gpu_readable:
            return self._lookup_direct(row_ids, stats)
        with torch.cuda.stream(self.stream):
            plan = self._plan(row_ids, stats)
        stats.mark("planned (dedup, sizes synced, zero-copy share queued)", start)
        future = None
        if plan["cpu_ids"] is not None:
            future = self._pool.submit(self._finish_gpu, plan, stats, start)
            self._pending = future
        else:
            self._finish_gpu(plan, stats, start)
        return LookupHandle(plan["out"], plan["event"], future, stats)

    def _lookup_direct(self, row_ids: torch.Tensor, stats: LookupStats) -> LookupHandle:
        """Small batches (decode): one gather kernel straight from the table (HBM or page-locked host).

        No dedup, no cache, no host sync: a few thousand rows cost one kernel of tens of
        microseconds, far less than the sort and synchronizations of the full path.
        """
        with torch.cuda.stream(self.stream):
            out = self.gather_into(row_ids)
            event = torch.cuda.Event()
            event.record(self.stream)
        stats.unique, stats.gpu_rows = -1, row_ids.numel()
        return LookupHandle(out, event, None, stats)

    def gather_into(self, row_ids: torch.Tensor, out: torch.Tensor | None = None, *,
                    max_programs: int | None = None) -> torch.Tensor:
        """The direct path on the current stream: rows [..., head_dim] bf16 read from the table in place.

        One kernel, no host work: what a CUDA graph captures (`GraphedDecoder` with a
        memory). Needs a store the GPU can read (HBM or page-locked host memory).
        `max_programs` caps the kernel's grid (fewer SMs held by a fetch that runs beside
        other work).
        """
        if not self.store.gpu_readable:
            raise ValueError(f"a {self.store.tier} store cannot be read by the GPU in place; use lookup()")
        return _rows_from_raw(row_ids, self.store.raw, self.store.format, self.store.head_dim, out,
                              max_programs=max_programs)

    def _plan(self, row_ids: torch.Tensor, stats: LookupStats) -> dict:
        """GPU side, first half: dedup, probe, zero-copy / HBM share; hands the CPU share to the worker."""
        flat = row_ids.reshape(-1)
        uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        n = uniq.numel()
        compact = torch.empty((n, self.store.row_bytes), dtype=torch.uint8, device=self.device)
        miss_pos = torch.arange(n, device=self.device)
        if self.cache is not None:
            slot = self.cache.probe(uniq)
            hit = slot >= 0
            hit_pos = torch.nonzero(hit).flatten()
            compact[hit_pos] = self.cache.read(slot[hit_pos])
            miss_pos = torch.nonzero(~hit).flatten()
        miss_ids = uniq[miss_pos]
        n_miss = miss_ids.numel()                      # (a sync: sizes decide the split)
        stats.unique, stats.hits = n, n - n_miss
        cpu_ids = None
        ids_ready = torch.cuda.Event()
        if self.store.tier == "hbm":
            compact[miss_pos] = self.store.raw.index_select(0, miss_ids)
            stats.gpu_rows = n_miss
        else:
            words = _as_words(self.store.raw) if self.store.gpu_readable else None
            fraction = 1.0 if words is None else self.cpu_fraction
            n_cpu = int(round(n_miss * fraction))
            # Sorted ids: the CPU takes one contiguous range of the sorted misses, the GPU the other.
            # The CPU's ids go to the host first, so the CPU gather starts while the zero-copy
            # kernel below still runs.
            if n_cpu:
                cpu_ids = miss_ids[:n_cpu].to("cpu", non_blocking=True)
                ids_ready.record(self.stream)
            if n_cpu < n_miss:
                got = engram_gather(miss_ids[n_cpu:], words)
                compact[miss_pos[n_cpu:]] = got.view(torch.uint8)
            stats.cpu_rows, stats.gpu_rows = n_cpu, n_miss - n_cpu
        out = torch.empty((*row_ids.shape, self.store.head_dim), dtype=torch.bfloat16, device=self.device)
        return {"inverse": inverse.view(row_ids.shape), "compact": compact, "miss_pos": miss_pos,
                "miss_ids": miss_ids, "cpu_ids": cpu_ids, "ids_ready": ids_ready, "event": torch.cuda.Event(),
                "out": out}

    def _finish_gpu(self, plan: dict, stats: LookupStats, start: float) -> None:
        """Second half: CPU share -> staging -> DMA (chunked), then admit and expand; records the event."""
        compact, miss_pos = plan["compact"], plan["miss_pos"]
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if plan["cpu_ids"] is not None:
                plan["ids_ready"].synchronize()                 # the ids have reached the host
                stats.mark("cpu ids on host", start)
                staged = self._cpu_share(plan["cpu_ids"], stats, start)
                compact[miss_pos[: staged.shape[0]]] = staged
            if self.cache is not None and plan["miss_ids"].numel():
                self.cache.admit(plan["miss_ids"], compact[miss_pos])
            self._expand(compact, plan["inverse"], out=plan["out"])
            plan["event"].record(self.stream)
        stats.mark("expand queued", start)
        stats.seconds = time.perf_counter() - start

    def _lookup_sync(self, row_ids: torch.Tensor, stats: LookupStats) -> torch.Tensor:
        """The same steps on the CPU (CI, CPU-only inference), synchronously."""
        flat = row_ids.reshape(-1)
        uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        compact = torch.empty((uniq.numel(), self.store.row_bytes), dtype=torch.uint8)
        miss_pos = torch.arange(uniq.numel())
        if self.cache is not None:
            slot = self.cache.probe(uniq)
            hit = slot >= 0
            compact[hit] = self.cache.read(slot[hit])
            miss_pos = torch.nonzero(~hit).flatten()
        miss_ids = uniq[miss_pos]
        compact[miss_pos] = self.store.gather_raw(miss_ids)
        if self.cache is not None:
            self.cache.admit(miss_ids, compact[miss_pos])
        stats.unique, stats.hits, stats.cpu_rows = uniq.numel(), uniq.numel() - miss_ids.numel(), miss_ids.numel()
        return self._expand(compact, inverse.view(row_ids.shape))

    # ------------------------------------------------------------------ tuning
    def time_lookup(self, batches: list[torch.Tensor], repeats: int = 3) -> float:
        """Median seconds of one lookup over `batches` (rotated), end to end on the device."""
        times = []
        for r in range(repeats):
            for ids in batches:
                if self.on_gpu:
                    torch.cuda.synchronize(self.device)
                t0 = time.perf_counter()
                self.lookup(ids).wait()
                if self.on_gpu:
                    torch.cuda.synchronize(self.device)
                times.append(time.perf_counter() - t0)
        times.sort()
        return times[len(times) // 2]

    def calibrate(self, n_ids: int = 1 << 18, candidates: tuple[float, ...] | None = None, seed: int = 0) -> float:
        """Pick `cpu_fraction` for a host store from measurements on uniform random ids.

        Each candidate split is timed end to end (the CPU gather, its DMA and the zero-copy
        gather share the PCIe link, so rates measured alone do not add up); the fastest
        wins. The cache is bypassed while measuring. Returns the chosen fraction.
        """
        if self.store.tier != "host" or not self.on_gpu or _as_words(self.store.raw) is None:
            return self.cpu_fraction
        gen = torch.Generator(device="cpu").manual_seed(seed)
        batches = [torch.randint(0, self.store.num_rows, (n_ids,), generator=gen).to(self.device) for _ in range(3)]
        cache, self.cache = self.cache, None
        results = {}
        try:
            for f in candidates or (0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
                self.cpu_fraction = f
                results[f] = self.time_lookup(batches, repeats=2)
        finally:
            self.cache = cache
        self.cpu_fraction = min(results, key=results.get)
        log.info("lookup split calibrated on %d random ids: %s -> cpu_fraction %.2f", n_ids,
                 ", ".join(f"{f:.1f}: {t * 1e3:.2f} ms" for f, t in results.items()), self.cpu_fraction)
        self.calibration = results
        return self.cpu_fraction

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
