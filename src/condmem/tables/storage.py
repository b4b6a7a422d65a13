"""Storage tiers for one layer's table: HBM, page-locked host DRAM, or a memory-mapped file.

Every tier holds the rows as *raw rows*: a uint8 tensor [rows, row_bytes] in the
table's row format, where fp8 rows are always interleaved (fp8 bytes, then the row's
e8m0 scale bytes: one random access per row), and bf16 rows are their 2*D bytes. Raw
rows are what caches hold and what the lookup engine moves; the gather kernel turns
them into bf16 [.., head_dim] at the end.

* `hbm`: a CUDA tensor; gathers run at HBM speed.
* `host`: a `HostBuffer` (see `host_memory`), page-locked so the GPU can read it
  zero-copy and DMA engines can copy from it.
* `disk`: the table file's bytes, memory-mapped: tables larger than DRAM. The OS page
  cache keeps recently read pages; `attach_dram_cache` adds a bounded DRAM `RowCache`
  of rows (so HBM cache -> DRAM cache -> file is the paper's multi-level hierarchy).
  The mapping is advised ``MADV_RANDOM``: a row is a few hundred bytes, and the kernel's
  default read-around turns each cold row into ~100 KiB of disk reads (measured on a
  virtual disk, 20K random rows of a 2 GiB file, page cache dropped: 79-103 KiB read per
  row and 1.7-2.3 s by default, 2.2 KiB per row and 0.48 s advised).
  Only interleaved (or bf16) files are mapped as raw rows; separate fp8 + scales
  files are read with two accesses per row.

`place_layer` copies a layer's rows (e.g. memory-mapped from a table file) into a
tier, in chunks, with a progress bar.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import time
from typing import Literal

import torch

from condmem import native
from condmem.tables.host_memory import HostAlloc, HostBuffer, allocate_host, collapse_huge_pages, report_coverage
from condmem.fp8 import pack_rows
from condmem.tables.row_cache import RowCache
from condmem.tables.safetensors_io import release_pages
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
        log.debug("madvise(MADV_RANDOM) refused (errno %d): the disk tier keeps the default read-around",
                  ctypes.get_errno())
    return ok


class StorageError(ValueError):
    """A table cannot be placed in the requested tier."""


def raw_format(fmt: str) -> str:
    """The format of raw rows for a table format: fp8 tables are always interleaved."""
    return "bf16" if fmt == "bf16" else "fp8_interleaved"


class LayerStore:
    """One layer's rows in one tier, as raw rows [rows, row_bytes] uint8.

    Attributes:
        tier: hbm, host or disk.
        format: "bf16" or "fp8_interleaved" (the raw-row format).
        head_dim: values per row.
        raw: uint8 [rows, row_bytes] (None for a disk tier on a separate-scales file).
    """

    def __init__(self, tier: str, fmt: str, head_dim: int, raw: torch.Tensor | None,
                 split: tuple[torch.Tensor, torch.Tensor] | None = None, buffer: HostBuffer | None = None):
        self.tier = tier
        self.format = fmt
        self.head_dim = head_dim
        self.raw = raw
        self._split = split
        self._buffer = buffer
        self.dram_cache: RowCache | None = None
        self._direct_reader = None

    @property
    def num_rows(self) -> int:
        return self.raw.shape[0] if self.raw is not None else self._split[0].shape[0]

    @property
    def row_bytes(self) -> int:
        return 2 * self.head_dim if self.format == "bf16" else self.head_dim + self.head_dim // 32

    @property
    def cpu_contiguous(self) -> bool:
        """True when `raw` is one contiguous CPU tensor: what the native gather and send read."""
        return self.raw is not None and self.raw.device.type == "cpu" and self.raw.is_contiguous()

    @property
    def device(self) -> torch.device:
        return self.raw.device if self.raw is not None else torch.device("cpu")

    @property
    def gpu_readable(self) -> bool:
        """True when a kernel can read `raw` directly (HBM, or page-locked host memory)."""
        if self.raw is None:
            return False
        if self.tier == "hbm":
            return True
        return self._buffer is not None and self._buffer.pinned

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_bytes

    @property
    def direct_reader(self):
        """Disk tier: a `DirectRowReader` that reads rows with O_DIRECT instead of the mapping (or None)."""
        return self._direct_reader

    @direct_reader.setter
    def direct_reader(self, reader) -> None:
        if reader is not None and self.tier != "disk":
            raise StorageError(f"a direct reader serves the disk tier; this store is {self.tier}")
        self._direct_reader = reader

    def attach_dram_cache(self, capacity_bytes: int, ways: int = 16) -> RowCache:
        """Put a DRAM `RowCache` in front of a disk store: the middle level of HBM -> DRAM -> disk.

        Rows read from the file are admitted to it; later reads of hot rows skip the file
        (and its page faults). Returns the cache (its `stats` count DRAM hits).
        """
        if self.tier != "disk":
            raise StorageError(f"a DRAM cache fronts the disk tier; this store is {self.tier}")
        self.dram_cache = RowCache.from_bytes(capacity_bytes, self.row_bytes, ways=ways, device="cpu")
        return self.dram_cache

    def gather_raw(self, ids: torch.Tensor, out: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
        """Raw rows at `ids` (on the store's device), into `out` when given ([n, row_bytes] uint8).

        On the CPU the native prefetching gather (`condmem.native`) is used when it is
        available, ``torch.index_select`` otherwise; a disk store with a DRAM cache serves hits
        from it.
        """
        if self.dram_cache is not None and ids.numel():
            return self._gather_through_cache(ids, out, threads)
        return self._gather_direct(ids, out, threads)

    def _gather_through_cache(self, ids: torch.Tensor, out: torch.Tensor | None, threads: int | None) -> torch.Tensor:
        cache = self.dram_cache
        uniq, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        if int(uniq[0]) < 0 or int(uniq[-1]) >= self.num_rows:
            bad = int(uniq[0]) if int(uniq[0]) < 0 else int(uniq[-1])
            raise StorageError(f"row id {bad} outside the table's 0..{self.num_rows - 1}")
        slot = cache.probe(uniq)
        hit = slot >= 0
        rows = torch.empty((uniq.numel(), self.row_bytes), dtype=torch.uint8)
        rows[hit] = cache.read(slot[hit])
        miss = torch.nonzero(~hit).flatten()
        if miss.numel():
            fetched = self._gather_direct(uniq[miss], None, threads)
            rows[miss] = fetched
            cache.admit(uniq[miss], fetched)
        if out is None:
            return rows.index_select(0, inverse)
        return torch.index_select(rows, 0, inverse, out=out)

    def _gather_direct(self, ids: torch.Tensor, out: torch.Tensor | None, threads: int | None) -> torch.Tensor:
        if self.direct_reader is not None:
            return self.direct_reader.read(ids, out)
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
        if self.direct_reader is not None:
            self.direct_reader.close()
            self.direct_reader = None
        self.raw = None
        self._split = None
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None

    def __repr__(self) -> str:
        return (f"LayerStore({self.tier}, {self.format}, {self.num_rows:,} rows x {self.row_bytes} B = "
                f"{self.nbytes / 2**30:.2f} GiB)")


def _raw_chunk(chunk: LayerRows) -> torch.Tensor:
    """A LayerRows chunk as raw uint8 rows."""
    if chunk.format == "bf16":
        return chunk.weight.contiguous().view(torch.uint8)
    if chunk.format == "fp8":
        return pack_rows(chunk.weight.contiguous(), chunk.scales.contiguous())
    return chunk.weight


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
) -> LayerStore:
    """Put one layer's rows into a tier.

    Args:
        rows: the layer's rows (e.g. `EngramTableFile.layer(id)`, memory-mapped).
        tier: "hbm", "host" or "disk" (disk keeps `rows` mapped where they are).
        device: the CUDA device for hbm (default: current).
        host_alloc: host strategy (see `condmem.tables.host_memory`); "pageable" on CPU-only machines.
        chunk_rows: rows copied at a time.
        progress: show a progress bar while copying / pinning.
        name: for logs.
        drop_source_cache: when `rows` are file mappings, unmap each copied chunk and drop its
            pages from the page cache (a second copy of the table in DRAM helps nothing).
    """
    if tier not in TIERS:
        raise StorageError(f"unknown tier {tier!r}; choose one of {TIERS}")
    rows.validate()
    d = rows.head_dim
    fmt = raw_format(rows.format)
    if tier == "disk":
        for t in (rows.weight, rows.scales):
            if t is not None:
                advise_random(t)
        if rows.format == "fp8":
            return LayerStore("disk", fmt, d, None, split=(rows.weight, rows.scales))
        raw = rows.weight.view(torch.uint8) if rows.format == "bf16" else rows.weight
        return LayerStore("disk", fmt, d, raw)
    row_bytes = 2 * d if fmt == "bf16" else d + d // 32
    n = rows.num_rows
    start = time.perf_counter()
    bar = Progress(n * row_bytes, f"{name} -> {tier}", enabled=progress, unit="B", unit_scale=True)
    if tier == "hbm":
        if not torch.cuda.is_available():
            raise StorageError("the hbm tier needs a CUDA device")
        dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        free, _ = torch.cuda.mem_get_info(dev)
        if n * row_bytes > free:
            raise StorageError(f"{name}: {n * row_bytes / 2**30:.2f} GiB does not fit the {free / 2**30:.2f} GiB free "
                               f"on {dev}; use the host tier")
        raw = torch.empty((n, row_bytes), dtype=torch.uint8, device=dev)
        buffer = None
    else:
        buffer = allocate_host(n * row_bytes, host_alloc, shared_name)
        raw = buffer.tensor.view(n, row_bytes)
    for s in range(0, n, chunk_rows):
        e = min(n, s + chunk_rows)
        piece = LayerRows(rows.format, rows.weight[s:e], None if rows.scales is None else rows.scales[s:e])
        raw[s:e].copy_(_raw_chunk(piece))
        if drop_source_cache:
            for t in (piece.weight, piece.scales):
                if t is not None:
                    release_pages(t, drop_cache=True)
        bar.update((e - s) * row_bytes)
    bar.close()
    if buffer is not None and buffer.strategy == "mmap_register":
        # Before page-locking: locked pages cannot be migrated into huge pages any more.
        cov = buffer.coverage()
        if cov is not None and cov < 0.98 and collapse_huge_pages(buffer):
            log.info("%s: MADV_COLLAPSE: huge-page coverage %.0f%% -> %.0f%%", name, 100 * cov,
                     100 * (buffer.coverage() or 0.0))
    if buffer is not None and buffer.strategy in ("mmap_register", "shared") and torch.cuda.is_available():
        t_pin = time.perf_counter()
        buffer.pin()
        log.info("%s: page-locked %.2f GiB in %.1f s", name, buffer.nbytes / 2**30, time.perf_counter() - t_pin)
    if buffer is not None and buffer.strategy != "pageable":
        report_coverage(buffer, name)
    log.info("%s: %s rows (%.2f GiB) placed in %s (%s) in %.1f s", name, f"{n:,}", n * row_bytes / 2**30, tier,
             host_alloc if tier == "host" else raw.device, time.perf_counter() - start)
    return LayerStore(tier, fmt, d, raw, buffer=buffer)
