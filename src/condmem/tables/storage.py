"""Storage backends for one layer's table: HBM, page-locked host DRAM, or a file on disk.

Every tier holds the rows as *raw rows*: a uint8 tensor [rows, row_bytes] in the
table's row format, where fp8 rows are always interleaved (fp8 bytes, then the row's
e8m0 scale bytes: one random access per row), and bf16 rows are their 2*D bytes. Raw
rows are what caches hold and what the lookup engine moves; the gather kernel turns
them into bf16 [.., head_dim] at the end.

* `hbm`: a CUDA tensor; gathers run at HBM speed.
* `host`: a `HostBuffer` (see `host_memory`), page-locked so the GPU can read it
  zero-copy and DMA engines can copy from it.
* `disk`: the table file's bytes, read with ``pread`` (through the page cache, or with
  O_DIRECT), every block checked, by `DirectRowReader`s: tables larger than DRAM.
  `with_dram_cache` wraps any store in a bounded DRAM `RowCache` of rows (so HBM cache ->
  DRAM cache -> file is the paper's multi-level hierarchy). Rows given without a file
  (tensors, e.g. a released checkpoint's mapping) are read through their mapping, advised
  ``MADV_RANDOM``: a row is a few hundred bytes, and the kernel's default read-around
  turns each cold row into a read of many pages (measured in docs/tables-and-tiers.md).
  Separate fp8 + scales tensors are read with two accesses per row.

`place_layer` puts a layer's rows into a tier. Rows of a table file (`LayerRows.source`)
are read with ``pread`` by parallel threads and every block is checked against its
recorded CRC32C as it lands (the host and HBM tiers), or at each read (the disk tier), so
a damaged or rewritten file is an error naming the file, tensor and block, never rows. A
shared host copy (``host_alloc="shared"``) is filled and checked by the one process that
creates it, before any other maps it; a process that attaches to it reads its own table file
(checked) into a private buffer and compares, never writing the copy.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import time
from typing import Literal

import torch

from condmem import native
from condmem.tables import integrity
from condmem.tables.errors import StorageError
from condmem.tables.host_memory import HostAlloc, HostBuffer, allocate_host, collapse_huge_pages, report_coverage
from condmem.fp8 import pack_rows
from condmem.tables.row_cache import RowCache
from condmem.tables.safetensors_io import TableFileError, release_pages
from condmem.tables.table_file import LayerRows
from condmem.utils.progress import Progress

log = logging.getLogger("condmem.tables")

Tier = Literal["hbm", "host", "disk"]
TIERS: tuple[str, ...] = ("hbm", "host", "disk")


def advise_random(t: torch.Tensor) -> bool:
    """Tell the kernel that the pages under CPU tensor `t` (a file mapping) are read at random:
    no read-around on a fault. Returns False where that is not possible (no madvise, not a
    mapping); reads stay correct either way."""
    advice = getattr(mmap, "MADV_RANDOM", None)
    if advice is None or t.device.type != "cpu" or t.numel() == 0:
        return False
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    end = t.data_ptr() + t.numel() * t.element_size()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(advice)) == 0
    except (OSError, AttributeError):
        return False
    if not ok:
        log.debug(
            "madvise(MADV_RANDOM) refused (errno %d): the disk tier keeps the default read-around", ctypes.get_errno()
        )
    return ok


def raw_format(fmt: str) -> str:
    """The format of raw rows for a table format: fp8 tables are always interleaved."""
    return "bf16" if fmt == "bf16" else "fp8_interleaved"


class LayerStore:
    """One layer's rows behind the storage interface, as raw rows [rows, row_bytes] uint8.

    A backend says what it can do, and the lookup engine asks that, never the tier's name:

    * `gpu_readable`: a kernel can read `raw` in place (HBM, page-locked host memory);
    * `in_device_memory`: `raw` is the GPU's own memory (misses read at HBM speed);
    * `cpu_share`: the share of a lookup's misses this store fixes for the CPU gather
      (0: none, the GPU reads them all; 1: all), or None where the engine's split decides;
    * `raw_in_place`: `gather_raw` reads `raw` itself (what the native staged send reads);
    * `gather_raw(ids, out)`: rows into a (staging) buffer on the CPU; `close()`.

    Backends: `HbmStore`, `HostStore`, `DiskStore`, and `DramCachedStore`, a DRAM row cache
    wrapped around another store (`with_dram_cache`).

    Threads: `gather_raw` may be called from several threads at once on every backend (each
    call reads into buffers of its own; the DRAM cache is locked); `close()` only once no
    other thread reads.

    Attributes:
        tier: the backend's name, for logs.
        format: "bf16" or "fp8_interleaved" (the raw-row format).
        head_dim: values per row.
        raw: uint8 [rows, row_bytes] (None for a disk store on a separate-scales file).
    """

    tier = "?"
    in_device_memory = False

    def __init__(
        self,
        fmt: str,
        head_dim: int,
        raw: torch.Tensor | None,
        split: tuple[torch.Tensor, torch.Tensor] | None = None,
        buffer: HostBuffer | None = None,
    ):
        self.format = fmt
        self.head_dim = head_dim
        self.raw = raw
        self._split = split
        self._buffer = buffer

    @property
    def num_rows(self) -> int:
        return self.raw.shape[0] if self.raw is not None else self._split[0].shape[0]

    @property
    def row_bytes(self) -> int:
        return 2 * self.head_dim if self.format == "bf16" else self.head_dim + self.head_dim // 32

    @property
    def cpu_contiguous(self) -> bool:
        """True when `raw` is one contiguous CPU tensor."""
        return self.raw is not None and self.raw.device.type == "cpu" and self.raw.is_contiguous()

    @property
    def raw_in_place(self) -> bool:
        """True when `gather_raw` reads the contiguous CPU tensor `raw` itself (no cache or reader
        in front of it): what the native gather and staged send read."""
        return self.cpu_contiguous

    @property
    def device(self) -> torch.device:
        return self.raw.device if self.raw is not None else torch.device("cpu")

    @property
    def gpu_readable(self) -> bool:
        """True when a kernel can read `raw` in place."""
        return False

    @property
    def cpu_share(self) -> float | None:
        """The share of a lookup's misses the CPU gathers from this store, when the store fixes it."""
        return None if self.gpu_readable else 1.0

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_bytes

    @property
    def direct_reader(self):
        """A `DirectRowReader` that reads rows with O_DIRECT instead of `raw` (disk stores only)."""
        return None

    @direct_reader.setter
    def direct_reader(self, reader) -> None:
        raise StorageError(f"a direct reader serves the disk tier; this store is {self.tier}")

    def with_dram_cache(self, capacity_bytes: int, ways: int = 16) -> DramCachedStore:
        """This store behind a bounded DRAM `RowCache` (the middle level of HBM -> DRAM -> disk)."""
        return DramCachedStore(self, capacity_bytes, ways)

    def gather_raw(
        self, ids: torch.Tensor, out: torch.Tensor | None = None, threads: int | None = None
    ) -> torch.Tensor:
        """Raw rows at `ids` (on the store's device), into `out` when given ([n, row_bytes] uint8).

        On the CPU the native prefetching gather (`condmem.native`) is used when it is
        available, ``torch.index_select`` otherwise.
        """
        if self.device.type == "cpu" and ids.numel():
            # The native gather trusts its ids; a bad one must be an error, not a stray read.
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.num_rows:
                raise StorageError(f"row id {lo if lo < 0 else hi} outside the table's 0..{self.num_rows - 1}")
        if self.raw is not None:
            if self.raw.device.type == "cpu" and ids.numel():
                if out is None:
                    out = torch.empty((ids.numel(), self.row_bytes), dtype=torch.uint8)
                if self.cpu_contiguous and native.available():
                    return native.gather_rows(self.raw, ids, out, threads)
            if out is None:
                return self.raw.index_select(0, ids)
            return torch.index_select(self.raw, 0, ids, out=out)
        weight, scales = self._split
        if out is None:
            out = torch.empty((ids.numel(), self.row_bytes), dtype=torch.uint8)
        d = self.head_dim
        out[:, :d].copy_(weight.view(torch.uint8).index_select(0, ids))
        out[:, d:].copy_(scales.index_select(0, ids))
        return out

    def close(self) -> None:
        self.raw = None
        self._split = None
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.format}, {self.num_rows:,} rows x {self.row_bytes} B = "
            f"{self.nbytes / 2**30:.2f} GiB)"
        )


class HbmStore(LayerStore):
    """Rows in GPU memory: every miss is read by the gather kernel at HBM speed, none by the CPU."""

    tier = "hbm"
    in_device_memory = True

    @property
    def gpu_readable(self) -> bool:
        return self.raw is not None

    @property
    def cpu_share(self) -> float:
        return 0.0


class HostStore(LayerStore):
    """Rows in host DRAM (a `HostBuffer`); page-locked, the GPU reads them in place over PCIe
    and the lookup engine splits misses between that and the CPU gather + DMA."""

    tier = "host"

    @property
    def gpu_readable(self) -> bool:
        return self.raw is not None and self._buffer is not None and self._buffer.pinned


class DiskStore(LayerStore):
    """Rows in a file, read by `DirectRowReader`s (``pread``, with or without O_DIRECT, every block
    checked), or through a memory map (``MADV_RANDOM``) when given as tensors; the CPU gathers every miss."""

    tier = "disk"

    def __init__(self, *args, readers: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._direct_reader = None
        self._readers = readers

    @property
    def num_rows(self) -> int:
        if self._readers is not None:
            return self._readers["weight"].num_rows
        return super().num_rows

    @property
    def direct_reader(self):
        return self._direct_reader if self._readers is None else self._readers["weight"]

    @direct_reader.setter
    def direct_reader(self, reader) -> None:
        if self._readers is not None:
            raise StorageError("this disk store reads its table file through its own checked readers")
        self._direct_reader = reader

    @property
    def raw_in_place(self) -> bool:
        return self._direct_reader is None and self._readers is None and self.cpu_contiguous

    def gather_raw(
        self, ids: torch.Tensor, out: torch.Tensor | None = None, threads: int | None = None
    ) -> torch.Tensor:
        if self._readers is not None:
            if "scales" not in self._readers:
                return self._readers["weight"].read(ids, out)
            if out is None:
                out = torch.empty((ids.numel(), self.row_bytes), dtype=torch.uint8)
            d = self.head_dim
            out[:, :d] = self._readers["weight"].read(ids)
            out[:, d:] = self._readers["scales"].read(ids)
            return out
        if self._direct_reader is not None:
            return self._direct_reader.read(ids, out)
        return super().gather_raw(ids, out, threads)

    def close(self) -> None:
        for reader in [self._direct_reader, *(self._readers or {}).values()]:
            if reader is not None:
                reader.close()
        self._direct_reader = None
        self._readers = None
        super().close()


class DramCachedStore(LayerStore):
    """Another store behind a bounded DRAM `RowCache` of rows (frequency-based, as the HBM cache):
    hits skip the store (the file's reads and page faults), misses are read from it and admitted.

    Memory use is the cache's capacity, whatever the table's size. `cache.stats` counts DRAM hits.
    Thread-safe: `gather_raw` probes and reads under the cache's lock; the misses are read
    from the inner store outside it.
    """

    def __init__(self, inner: LayerStore, capacity_bytes: int, ways: int = 16):
        super().__init__(inner.format, inner.head_dim, inner.raw, split=inner._split)
        self.inner = inner
        self.tier = inner.tier
        self.cache = RowCache.from_bytes(capacity_bytes, inner.row_bytes, ways=ways, device="cpu")

    @property
    def num_rows(self) -> int:
        return self.inner.num_rows

    @property
    def raw_in_place(self) -> bool:
        return False

    @property
    def cpu_share(self) -> float:
        return 1.0

    def gather_raw(
        self, ids: torch.Tensor, out: torch.Tensor | None = None, threads: int | None = None
    ) -> torch.Tensor:
        if not ids.numel():
            return self.inner.gather_raw(ids, out, threads)
        uniq, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        if int(uniq[0]) < 0 or int(uniq[-1]) >= self.num_rows:
            bad = int(uniq[0]) if int(uniq[0]) < 0 else int(uniq[-1])
            raise StorageError(f"row id {bad} outside the table's 0..{self.num_rows - 1}")
        rows = torch.empty((uniq.numel(), self.row_bytes), dtype=torch.uint8)
        with self.cache.lock:  # no other thread's admission between the probe and the read of its slots
            slot = self.cache.probe(uniq)
            hit = slot >= 0
            rows[hit] = self.cache.read(slot[hit])
        miss = torch.nonzero(~hit).flatten()
        if miss.numel():
            # Read outside the lock (threads' file reads overlap); an id another thread admitted
            # meanwhile is not admitted twice.
            fetched = self.inner.gather_raw(uniq[miss], None, threads)
            rows[miss] = fetched
            self.cache.admit(uniq[miss], fetched)
        if out is None:
            return rows.index_select(0, inverse)
        return torch.index_select(rows, 0, inverse, out=out)

    def close(self) -> None:
        self.inner.close()
        self.raw = None
        self._split = None


_BACKENDS = {"hbm": HbmStore, "host": HostStore, "disk": DiskStore}


def _raw_chunk(chunk: LayerRows) -> torch.Tensor:
    """A LayerRows chunk as raw uint8 rows."""
    if chunk.format == "bf16":
        return chunk.weight.contiguous().view(torch.uint8)
    if chunk.format == "fp8":
        return pack_rows(chunk.weight.contiguous(), chunk.scales.contiguous())
    return chunk.weight


def _disk_store(rows: LayerRows, fmt: str, d: int, direct_io: bool, threads: int | None) -> DiskStore:
    """The disk tier: a table file's rows read with ``pread`` (checked), or tensors read through their mapping."""
    if rows.source is not None:
        return DiskStore(fmt, d, None, readers=rows.source.reader(direct=direct_io, threads=threads or 32))
    for t in (rows.weight, rows.scales):
        if t is not None:
            advise_random(t)
    if rows.format == "fp8":
        return DiskStore(fmt, d, None, split=(rows.weight, rows.scales))
    raw = rows.weight.view(torch.uint8) if rows.format == "bf16" else rows.weight
    return DiskStore(fmt, d, raw)


def _allocate_hbm(n: int, row_bytes: int, device: str | torch.device | None, name: str) -> torch.Tensor:
    """Uninitialized raw rows [n, row_bytes] on the CUDA device (default: current), if they fit its free memory."""
    if not torch.cuda.is_available():
        raise StorageError("the hbm tier needs a CUDA device")
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    free, _ = torch.cuda.mem_get_info(dev)
    if n * row_bytes > free:
        raise StorageError(
            f"{name}: {n * row_bytes / 2**30:.2f} GiB does not fit the {free / 2**30:.2f} GiB free "
            f"on {dev}; use the host tier"
        )
    return torch.empty((n, row_bytes), dtype=torch.uint8, device=dev)


def _copy_tensor_rows(
    rows: LayerRows, raw: torch.Tensor, bar: Progress, chunk_rows: int, drop_source_cache: bool
) -> None:
    """Rows given as tensors (no table file) into `raw`, `chunk_rows` at a time; with `drop_source_cache`
    each copied chunk's pages are released from the page cache."""
    n = rows.num_rows
    row_bytes = raw.shape[1]
    for s in range(0, n, chunk_rows):
        e = min(n, s + chunk_rows)
        piece = LayerRows(rows.format, rows.weight[s:e], None if rows.scales is None else rows.scales[s:e])
        raw[s:e].copy_(_raw_chunk(piece))
        if drop_source_cache:
            for t in (piece.weight, piece.scales):
                if t is not None:
                    release_pages(t, drop_cache=True)
        bar.update((e - s) * row_bytes)


def _settle_host_buffer(buffer: HostBuffer, name: str) -> None:
    """After the copy: huge pages collapsed where coverage is low, then page-locked (mmap_register, shared: with
    CUDA) and the coverage reported (all but pageable)."""
    if buffer.strategy == "mmap_register":
        # Before page-locking: locked pages cannot be migrated into huge pages any more.
        cov = buffer.coverage()
        if cov is not None and cov < 0.98 and collapse_huge_pages(buffer):
            log.info(
                "%s: MADV_COLLAPSE: huge-page coverage %.0f%% -> %.0f%%",
                name,
                100 * cov,
                100 * (buffer.coverage() or 0.0),
            )
    if buffer.strategy in ("mmap_register", "shared") and torch.cuda.is_available():
        t_pin = time.perf_counter()
        buffer.pin()
        log.info("%s: page-locked %.2f GiB in %.1f s", name, buffer.nbytes / 2**30, time.perf_counter() - t_pin)
    if buffer.strategy != "pageable":
        report_coverage(buffer, name)


def _read_source(
    source, raw: torch.Tensor, bar: Progress, threads: int | None, drop_cache: bool, chunk_rows: int
) -> None:
    """Every row of a table file's `source` into `raw` (CPU: in place; HBM: through a CPU staging
    buffer of `chunk_rows` rows), every block checked; a mismatch is a `TableFileError` naming the file."""
    try:
        if raw.device.type == "cpu":
            source.read(raw, threads=threads, progress=bar.update, drop_cache=drop_cache)
            return
        step = max(1, min(source.num_rows, chunk_rows))
        staging = torch.empty((step, source.row_bytes), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        for s in range(0, source.num_rows, step):
            e = min(source.num_rows, s + step)
            source.read(staging[: e - s], start=s, threads=threads, progress=bar.update, drop_cache=drop_cache)
            raw[s:e].copy_(staging[: e - s])
        torch.cuda.synchronize(raw.device)
    except integrity.IntegrityMismatch as exc:
        raise TableFileError(f"{source.path}: {exc}") from None


_CHECK_STAGING_BYTES = 64 * 2**20
"""Rows a process attached to a published shared copy reads and compares at a time (its private buffer)."""


def _check_published(
    rows: LayerRows,
    raw: torch.Tensor,
    buffer: HostBuffer,
    bar: Progress,
    threads: int | None,
    drop_cache: bool,
    chunk_rows: int,
    name: str,
) -> None:
    """A shared copy another process filled and published, compared with this process's own rows: read (a table
    file's blocks checked) into a private staging buffer, a chunk at a time, never into the copy, which is not
    written. A damaged table file is a `TableFileError` naming it (tensor, block); rows that differ from the
    copy are a `StorageError` naming the copy and the first row."""
    n, row_bytes = raw.shape
    step = max(1, min(n, chunk_rows, _CHECK_STAGING_BYTES // row_bytes))
    staging = torch.empty((step, row_bytes), dtype=torch.uint8)
    what = rows.source.path if rows.source is not None else "the rows given"
    for s in range(0, n, step):
        e = min(n, s + step)
        mine = staging[: e - s]
        if rows.source is not None:
            try:
                rows.source.read(mine, start=s, threads=threads, progress=bar.update, drop_cache=drop_cache)
            except integrity.IntegrityMismatch as exc:
                raise TableFileError(
                    f"{rows.source.path}: {exc}; refused (the shared copy {buffer._path} others serve is untouched)"
                ) from None
        else:
            _copy_tensor_rows(rows.slice_rows(s, e), mine, bar, chunk_rows, drop_cache)
        if not torch.equal(mine, raw[s:e]):
            first = s + int(torch.nonzero((mine != raw[s:e]).any(dim=1))[0])
            raise StorageError(
                f"{name}: the shared copy {buffer._path} differs from {what} at row {first:,}: refused (the "
                "copy is not written; its last user removes it)"
            )


def place_layer(
    rows: LayerRows,
    tier: Tier,
    *,
    device: str | torch.device | None = None,
    host_alloc: HostAlloc = "mmap_register",
    shared_name: str | None = None,
    chunk_rows: int = 1 << 20,
    progress: bool = True,
    name: str = "table",
    drop_source_cache: bool = False,
    direct_io: bool = False,
    threads: int | None = None,
) -> LayerStore:
    """Put one layer's rows into a tier.

    Rows of a table file (`rows.source`, as `EngramTableFile.layer` gives them) are read from
    the file with ``pread`` and every block is checked against its recorded checksum: by
    `threads` threads as they are copied (host, hbm), or at each read (disk). A damaged block
    raises `TableFileError` (host, hbm: naming the file, tensor and block) or `StorageError`
    (disk: at the read that touches it).

    Args:
        rows: the layer's rows (e.g. `EngramTableFile.layer(id)`).
        tier: "hbm", "host" or "disk" (disk reads the rows where they are).
        device: the CUDA device for hbm (default: current).
        host_alloc: host strategy (see `condmem.tables.host_memory`); "pageable" on CPU-only machines.
            "shared" (with `shared_name`): the process that creates the copy fills and checks it before
            any other maps it; one that attaches compares it with its own rows (read and checked into a
            private buffer) and never writes it: a damaged file is a `TableFileError`, a copy that
            differs a `StorageError`.
        shared_name: the copy's /dev/shm name (`host_memory.shared_table_name`) for "shared".
        chunk_rows: rows copied at a time (tensors without a source; the HBM tier's staging).
        progress: show a progress bar while copying / pinning.
        name: for logs.
        drop_source_cache: drop the copied bytes from the page cache (a second copy of the table
            in DRAM helps nothing); mapped tensors are unmapped chunk by chunk too.
        direct_io: disk tier: read with ``O_DIRECT`` (the page cache never fills).
        threads: threads that read and check a table file (default: one per core, at most 32);
            the disk tier's reads in flight (default 32).
    """
    if tier not in TIERS:
        raise StorageError(f"unknown tier {tier!r}; choose one of {TIERS}")
    rows.validate()
    d = rows.head_dim
    fmt = raw_format(rows.format)
    if direct_io and (tier != "disk" or rows.source is None):
        raise StorageError(
            f"{name}: direct reads serve the disk tier from a table file (tier {tier!r}, "
            f"{'a table file' if rows.source is not None else 'rows without a file'})"
        )
    if tier == "disk":
        return _disk_store(rows, fmt, d, direct_io, threads)
    row_bytes = 2 * d if fmt == "bf16" else d + d // 32
    n = rows.num_rows
    start = time.perf_counter()
    bar = Progress(n * row_bytes, f"{name} -> {tier}", enabled=progress, unit="B", unit_scale=True)

    def fill(raw: torch.Tensor) -> None:
        if rows.source is not None:
            _read_source(rows.source, raw, bar, threads, drop_source_cache, chunk_rows)
        else:
            _copy_tensor_rows(rows, raw, bar, chunk_rows, drop_source_cache)

    if tier == "hbm":
        raw, buffer = _allocate_hbm(n, row_bytes, device, name), None
        fill(raw)
    else:
        # A table-named shared buffer runs `fill` only in the process that creates it, before any other maps it.
        buffer = allocate_host(n * row_bytes, host_alloc, shared_name, fill=lambda t: fill(t.view(n, row_bytes)))
        raw = buffer.tensor.view(n, row_bytes)
    try:
        if buffer is not None and buffer.attached:
            _check_published(rows, raw, buffer, bar, threads, drop_source_cache, chunk_rows, name)
        bar.close()
        if buffer is not None:
            _settle_host_buffer(buffer, name)
    except BaseException:
        if buffer is not None:
            buffer.close()
        raise
    log.info(
        "%s: %s rows (%.2f GiB) placed in %s (%s) in %.1f s",
        name,
        f"{n:,}",
        n * row_bytes / 2**30,
        tier,
        host_alloc if tier == "host" else raw.device,
        time.perf_counter() - start,
    )
    return _BACKENDS[tier](fmt, d, raw, buffer=buffer)
