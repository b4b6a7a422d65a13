"""The disk tier with O_DIRECT reads, cold and in steady state, against the disk's own random-read rate.

One run, one table file of 264 B rows (fp8 + e8m0, V4.1 geometry: 24 columns per token):

1. **write**: the file, with large sequential ``O_DIRECT`` writes (measured: GB/s), as large
   as ``--gib`` or as the write budget allows. Every row is distinct (its index is stamped
   into its first bytes), so a row read from the wrong place cannot pass the check.
2. **probe**: random aligned 4 KiB ``O_DIRECT`` reads (`DirectRowReader` with 4 KiB rows) at
   the tier's thread count (its queue depth) and at others: the rate the device allows.
3. **cold**: fresh uniform 16K-token batches through the tier (``LayerStore`` with a
   `DirectRowReader` and an emptied DRAM row cache, read by a `LookupEngine` into GPU
   memory when there is a GPU), page cache dropped first: rows/s against the probe; a
   sample of rows compared with the file (``torch.equal``).
4. **decode**: 1, 16 and 256 tokens, cold (fresh ids) and warm (the same ids again: DRAM hits).
5. **steady**: a text stream (the standard library through the DeepSeek-V4 tokenizer,
   hashed to this table's rows) for ``--steady-s`` seconds with the DRAM cache
   (``--cache-gib``) in front: hit rates, rows/s, tokens/s.

``Cached`` of /proc/meminfo and the file's own page-cache residency (mincore) are read
before and after the reads: direct reads must not grow them.

    PYTHONPATH=src python3 benchmarks/disk_direct.py --dir /path/on/the/disk --gib 40 --cache-gib 4 --out DIR
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import shutil
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from condmem.bench.lookup_setup import HEAD_DIM, N_COLS, ROW_BYTES, fill_table, text_row_ids
from condmem.ops.gather import engram_gather
from condmem.tables.direct_read import DirectRowReader
from condmem.tables.storage import place_layer
from condmem.tables.table_file import LayerRows
from condmem.utils.code_version import short_commit

BLOCK = 4096
CHUNK_ROWS = 4096 * 62  # a write chunk: 64 MiB - 0.06 MiB, whole rows and whole 4 KiB blocks


def log(*args) -> None:
    print(time.strftime("%H:%M:%S"), *args, flush=True)


def meminfo() -> dict[str, float]:
    """Cached, Dirty, MemAvailable from /proc/meminfo, in GiB."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        if key in ("Cached", "Dirty", "MemAvailable", "MemTotal"):
            out[key + "_gib"] = int(value.split()[0]) / 2**20
    return out


def rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def resident_fraction(path: Path) -> float:
    """Share of the file's pages in the page cache (mincore on a fresh mapping)."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        pages = -(-size // mmap.PAGESIZE)
        vec = np.zeros(pages, dtype=np.uint8)
        ok = libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec.ctypes.data_as(ctypes.c_void_p)) == 0
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    return float((vec & 1).mean()) if ok else float("nan")


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def pick_dir(candidates: list[str]) -> Path:
    """The candidate folder with the most free space whose file system takes O_DIRECT."""
    for d in sorted(candidates, key=lambda d: -shutil.disk_usage(d).free):
        probe = Path(d) / "condmem-odirect-probe"
        try:
            probe.write_bytes(b"\0" * BLOCK)
            os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
            return Path(d)
        except OSError as exc:
            log(f"{d}: no O_DIRECT ({exc})")
        finally:
            probe.unlink(missing_ok=True)
    raise SystemExit(f"none of {candidates} takes O_DIRECT reads")


def write_file(path: Path, want_bytes: int, budget_s: float) -> dict:
    """Sequential O_DIRECT writes of 64 MiB chunks until `want_bytes` or `budget_s`; returns what was written."""
    chunk_bytes = CHUNK_ROWS * ROW_BYTES
    buf = mmap.mmap(-1, chunk_bytes)  # page-aligned, as O_DIRECT needs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        rows = torch.frombuffer(buf, dtype=torch.uint8).view(CHUNK_ROWS, ROW_BYTES)
    fill_table(rows, block_rows=CHUNK_ROWS)
    shifts = torch.arange(5, dtype=torch.int64) * 6
    local = torch.arange(CHUNK_ROWS, dtype=torch.int64)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        direct = True
    except OSError:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        direct = False
    written, t0 = 0, time.perf_counter()
    try:
        while written + chunk_bytes <= want_bytes and (written == 0 or time.perf_counter() - t0 < budget_s):
            first = written // ROW_BYTES
            # The row's index in 6-bit groups, shifted left one bit: even bytes <= 126, finite fp8.
            rows[:, :5] = ((((local + first)[:, None] >> shifts) & 63) << 1).to(torch.uint8)
            view = memoryview(buf)
            done = 0
            while done < chunk_bytes:
                done += os.pwrite(fd, view[done:], written + done)
            del view
            written += chunk_bytes
            if not direct:
                os.posix_fadvise(fd, written - chunk_bytes, chunk_bytes, os.POSIX_FADV_DONTNEED)
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    del rows
    buf.close()
    if not direct:
        drop_cache(path)
    return {
        "bytes": written,
        "gib": written / 2**30,
        "seconds": seconds,
        "gb_per_s": written / seconds / 1e9,
        "o_direct": direct,
        "chunk_bytes": chunk_bytes,
    }


def expected_rows(ids: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """The file's rows at `ids` computed from the write pattern (no read): the chunk template
    row plus the stamped index."""
    rows = template[ids % CHUNK_ROWS].clone()
    shifts = torch.arange(5, dtype=torch.int64) * 6
    rows[:, :5] = (((ids[:, None] >> shifts) & 63) << 1).to(torch.uint8)
    return rows


def file_rows(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """Rows read from the file with plain preads (then their pages dropped again)."""
    out = torch.empty(ids.numel(), ROW_BYTES, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        for i, rid in enumerate(ids.tolist()):
            out[i] = torch.frombuffer(bytearray(os.pread(fd, ROW_BYTES, rid * ROW_BYTES)), dtype=torch.uint8)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return out


def probe_rate(path: Path, nbytes: int, threads: int, n: int, gen: torch.Generator) -> dict:
    reader = DirectRowReader(path, 0, BLOCK, nbytes // BLOCK, threads=threads)
    ids = torch.randint(0, nbytes // BLOCK, (n,), generator=gen)
    drop_cache(path)
    t0 = time.perf_counter()
    reader.read(ids)
    seconds = time.perf_counter() - t0
    reader.close()
    unique = ids.unique().numel()
    return {
        "threads": threads,
        "reads": unique,
        "seconds": seconds,
        "reads_per_s": unique / seconds,
        "gb_per_s": unique * BLOCK / seconds / 1e9,
    }


class Tier:
    """The disk tier as EngramMemory builds it (direct reader, DRAM cache), read by a LookupEngine."""

    def __init__(self, path: Path, rows: int, cache_gib: float, device: str, threads: int | None = None):
        with warnings.catch_warnings():  # a read-only map; nothing writes through it
            warnings.simplefilter("ignore", UserWarning)
            mapped = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="r", shape=(rows, ROW_BYTES)))
        self.store = place_layer(LayerRows("fp8_interleaved", mapped), "disk", progress=False, name="bench disk")
        reader_kw = {} if threads is None else {"threads": threads}  # default: the tier's own
        self.reader = DirectRowReader(path, 0, ROW_BYTES, rows, **reader_kw)
        self.store.direct_reader = self.reader
        self.cache = None
        if cache_gib > 0:
            self.store = self.store.with_dram_cache(int(cache_gib * 2**30))
            self.cache = self.store.cache
        self.device = device
        self.engine = None
        if device == "cuda":
            from condmem.tables.lookup import LookupEngine

            self.engine = LookupEngine(self.store, device)

    def read(self, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Rows of `ids` [T, 24] (bf16 on the GPU through the engine, else raw rows on the CPU) and seconds."""
        if self.engine is not None:
            ids = ids.to(self.device)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            rows = self.engine.lookup(ids).wait()
            torch.cuda.synchronize()
            return rows, time.perf_counter() - t0
        t0 = time.perf_counter()
        rows = self.store.gather_raw(ids.reshape(-1))
        return rows, time.perf_counter() - t0

    def cache_counts(self) -> tuple[int, int]:
        if self.cache is None:
            return 0, 0
        s = self.cache.stats
        return s.lookups, s.hits

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.store.close()


def check_sample(
    tier: Tier, path: Path, ids: torch.Tensor, rows: torch.Tensor, template: torch.Tensor, gen: torch.Generator, n: int
) -> dict:
    """A sample of a batch's rows against the file (read with plain preads) and the write pattern."""
    flat = ids.reshape(-1)
    pick = torch.randint(0, flat.numel(), (min(n, flat.numel()),), generator=gen)
    want = file_rows(path, flat[pick])
    pattern_ok = torch.equal(want, expected_rows(flat[pick], template))
    raw_ok = torch.equal(tier.store.gather_raw(flat[pick]), want)
    if rows.dtype == torch.bfloat16:
        got = rows.reshape(-1, HEAD_DIM)[pick.to(rows.device)]
        ref = engram_gather(torch.arange(pick.numel(), device=rows.device), want.to(rows.device), head_dim=HEAD_DIM)
        rows_ok = torch.equal(got.view(torch.int16), ref.view(torch.int16))
    else:
        rows_ok = torch.equal(rows[pick], want)
    return {
        "sample": int(pick.numel()),
        "file_matches_write_pattern": pattern_ok,
        "tier_rows_equal_file": rows_ok,
        "store_gather_equal_file": raw_ok,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--dir",
        nargs="+",
        default=["."],
        help="candidate folders: the one with most free space that takes O_DIRECT holds the file",
    )
    ap.add_argument("--gib", type=float, default=40.0, help="table file size (less if the disk or budget is short)")
    ap.add_argument("--write-budget-s", type=float, default=75.0, help="stop writing after this long")
    ap.add_argument("--cache-gib", type=float, default=4.0, help="the tier's DRAM row cache")
    ap.add_argument(
        "--probe-threads", type=int, nargs="*", default=[16, 64], help="probe thread counts besides the tier's"
    )
    ap.add_argument("--probe-reads", type=int, default=100_000)
    ap.add_argument(
        "--probe-after", action="store_true", help="probe again at the tier's threads after the cold batches"
    )
    ap.add_argument("--threads", type=int, default=None, help="the tier's reader threads (default: DirectRowReader's)")
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--cold-batches", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, nargs="*", default=[1, 16, 256])
    ap.add_argument("--decode-repeats", type=int, default=5)
    ap.add_argument("--steady-s", type=float, default=45.0, help="seconds of the text stream")
    ap.add_argument("--steady-tokens", type=int, default=1_000_000, help="text tokens prepared for the stream")
    ap.add_argument("--sample", type=int, default=4096, help="rows compared with the file")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--keep", action="store_true", help="keep the file")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()

    folder = pick_dir(args.dir)
    path = folder / "condmem-disk-bench.rows"
    free = shutil.disk_usage(folder).free + (path.stat().st_size if path.exists() else 0)
    want = min(int(args.gib * 2**30), free - (4 << 30))
    result: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "args": vars(args),
        "dir": str(folder),
        "row_bytes": ROW_BYTES,
        "meminfo_start": meminfo(),
    }
    result["commit"] = short_commit()
    log(f"writing up to {want / 2**30:.1f} GiB to {path} (free {free / 2**30:.1f} GiB)")
    result["write"] = write_file(path, want, args.write_budget_s)
    nbytes = result["write"]["bytes"]
    rows_total = nbytes // ROW_BYTES
    result["file_gib"], result["rows"] = nbytes / 2**30, rows_total
    result["meminfo_after_write"] = meminfo()
    log("write", result["write"], result["meminfo_after_write"])
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    def save():
        (out_dir / "disk_direct.json").write_text(json.dumps(result, indent=1) + "\n")

    # The text stream is prepared before the "before" reading: reading the corpus fills the page cache.
    t0 = time.perf_counter()
    text_ids, source = text_row_ids(rows_total, args.steady_tokens)
    result["text"] = {"source": source, "tokens": int(text_ids.shape[0]), "prepare_s": time.perf_counter() - t0}
    log("text", result["text"])
    template = torch.empty(CHUNK_ROWS, ROW_BYTES, dtype=torch.uint8)
    fill_table(template, block_rows=CHUNK_ROWS)
    gen = torch.Generator().manual_seed(0)
    drop_cache(path)
    result["before_reads"] = {**meminfo(), "file_resident": resident_fraction(path), "rss_gib": rss_gib()}
    log("before reads", result["before_reads"])

    tier = Tier(path, rows_total, args.cache_gib, args.device, args.threads)
    threads = tier.reader.threads
    result["tier"] = {
        "threads": threads,
        "dram_cache_gib": args.cache_gib,
        "dram_cache_rows": tier.cache.capacity_rows if tier.cache is not None else 0,
        "engine": "LookupEngine -> " + args.device if tier.engine is not None else "LayerStore.gather_raw",
    }
    probes = [probe_rate(path, nbytes, threads, args.probe_reads, gen)]
    for t in args.probe_threads:
        if t != threads:
            probes.append(probe_rate(path, nbytes, t, args.probe_reads // 2, gen))
    result["probe"] = probes
    for p in probes:
        log("probe", p)
    save()

    # Cold: fresh uniform ids, page cache dropped, DRAM cache emptied.
    cold = []
    for _ in range(args.cold_batches):
        ids = torch.randint(0, rows_total, (args.batch_tokens, N_COLS), generator=gen)
        unique = ids.unique().numel()
        drop_cache(path)
        if tier.cache is not None:
            tier.cache.clear()
        rows, seconds = tier.read(ids)
        cold.append({"ids": ids.numel(), "unique": unique, "ms": seconds * 1e3, "rows_per_s": unique / seconds})
        log("cold", cold[-1])
    rate = statistics.median(c["rows_per_s"] for c in cold)
    result["cold"] = {
        "batches": cold,
        "rows_per_s": rate,
        "vs_probe": rate / probes[0]["reads_per_s"],
        "check": check_sample(tier, path, ids, rows, template, gen, args.sample),
    }
    log("cold", {k: v for k, v in result["cold"].items() if k != "batches"})
    if args.probe_after:
        result["probe_after"] = probe_rate(path, nbytes, threads, args.probe_reads, gen)
        log("probe after", result["probe_after"])
    save()

    # Decode-sized lookups: cold (fresh ids, first use of each size warmed on other ids) and warm (DRAM hits).
    decode = []
    for t in args.decode_tokens:
        tier.read(torch.randint(0, rows_total, (t, N_COLS), generator=gen))
        cold_ms, warm_ms = [], []
        for _ in range(args.decode_repeats):
            ids = torch.randint(0, rows_total, (t, N_COLS), generator=gen)
            cold_ms.append(tier.read(ids)[1] * 1e3)
        for _ in range(args.decode_repeats):
            warm_ms.append(tier.read(ids)[1] * 1e3)
        decode.append(
            {
                "tokens": t,
                "ids": t * N_COLS,
                "cold_ms": statistics.median(cold_ms),
                "warm_ms": statistics.median(warm_ms),
                "cold_all": cold_ms,
                "warm_all": warm_ms,
            }
        )
        log("decode", decode[-1])
    result["decode"] = decode
    save()

    # Steady: the text stream through the DRAM cache, from empty, for --steady-s seconds.
    if tier.cache is not None:
        tier.cache.clear()
        tier.cache.reset_stats()
    steady, t_start = [], time.perf_counter()
    for s in range(0, text_ids.shape[0] - args.batch_tokens + 1, args.batch_tokens):
        if time.perf_counter() - t_start > args.steady_s or args.steady_s <= 0:
            break
        ids = text_ids[s : s + args.batch_tokens]
        before = tier.cache_counts()
        rows, seconds = tier.read(ids)
        after = tier.cache_counts()
        probed, hits = after[0] - before[0], after[1] - before[1]
        steady.append(
            {
                "batch": len(steady),
                "unique": ids.unique().numel(),
                "probed": probed,
                "hits": hits,
                "hit_rate": hits / max(1, probed),
                "disk_rows": probed - hits,
                "ms": seconds * 1e3,
                "disk_rows_per_s": (probed - hits) / seconds,
                "tokens_per_s": args.batch_tokens / seconds,
            }
        )
        log("steady", steady[-1])
    if not steady:
        result["after_reads"] = {**meminfo(), "file_resident": resident_fraction(path), "rss_gib": rss_gib()}
        tier.close()
        save()
        if not args.keep:
            path.unlink()
        return
    last = steady[-5:]
    filled = int((tier.cache.keys >= 0).sum()) if tier.cache is not None else 0
    result["steady"] = {
        "batches": steady,
        "tokens": len(steady) * args.batch_tokens,
        "last5": {
            k: statistics.median(b[k] for b in last)
            for k in ("hit_rate", "ms", "disk_rows_per_s", "tokens_per_s", "unique")
        },
        "first3_hit_rate": [b["hit_rate"] for b in steady[:3]],
        "dram_cache_rows_filled": filled,
        "check": check_sample(tier, path, ids, rows, template, gen, args.sample),
    }
    log("steady", {k: v for k, v in result["steady"].items() if k != "batches"})
    # File pages were read above for the checks (then dropped); the reading that matters is this one.
    result["after_reads"] = {**meminfo(), "file_resident": resident_fraction(path), "rss_gib": rss_gib()}
    log("after reads", result["after_reads"])
    tier.close()
    save()
    if not args.keep:
        path.unlink()


if __name__ == "__main__":
    main()
