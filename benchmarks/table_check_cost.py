"""What checking every served byte of a table file costs: host-tier load and a cold disk-tier batch.

One table file of 264 B rows (fp8 + e8m0 interleaved, one layer), ``--gib`` large (default 32),
written by `write_table_file` (a CRC32C per 4 KiB block); every row distinct (its index
stamped into its first 8 bytes), so a row read from the wrong place cannot pass the checks.

1. **write**: the file through the table writer (its CRCs computed as the bytes pass): GB/s.
2. **host**: the layer loaded into host memory (``mmap_register`` buffers, one per load) from
   the page cache (the file was just written: the worst case for the ratio, nothing hides the
   CPU work) by the tier's parallel ``pread`` reader, with every block checked and without
   checks, alternated, ``--repeats`` each: the ratio of medians. Then the mapped copy the
   host tier used before (no checks), for reference, and the real call (`place_layer`,
   page-locking included) once.
3. **disk**: cold uniform 16K-token batches (16384 x 24 row ids), the file's page cache
   dropped before each (``POSIX_FADV_DONTNEED``), read by the disk tier's reader with the
   per-read block checks and without, ``O_DIRECT`` and buffered, alternated: rows/s and the
   ratio of medians; a buffered batch read again from the page cache (warm), both ways.
4. **negative control**: a byte flipped in the file: the checked host read and disk read both refuse it.

Rows are compared with the pattern they were written from (`torch.equal`) after each variant.
Needs the native library (``checksum.c``); a Linux machine with 2.2 x ``--gib`` of free RAM
and ``--gib`` of free disk under ``--dir``. Run as root to drop the page cache.

    PYTHONPATH=src python3 benchmarks/table_check_cost.py --dir /tmp --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from condmem import EngramConfig, EngramLayout, native
from condmem.bench.harness import machine_info
from condmem.tables import integrity
from condmem.tables.direct_read import DirectRowReader
from condmem.tables.host_memory import allocate_host
from condmem.tables.safetensors_io import release_pages
from condmem.tables.errors import StorageError
from condmem.tables.storage import place_layer
from condmem.tables.table_file import EngramTableFile, LayerRows, write_table_file

ROW_BYTES = 264
N_COLS = 24  # row ids per token at V4.1 geometry (3 orders x 8 heads)
PATTERN_ROWS = 1 << 20  # the random block the rows are tiled from
T0 = time.perf_counter()


def log(*args) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s]", *args, flush=True)


def layout_for(gib: float) -> EngramLayout:
    """One Engram layer, one 2-gram head: its prime is the row count, about `gib` of 264 B rows."""
    rows = int(gib * 2**30 / ROW_BYTES)
    return EngramLayout(
        EngramConfig(
            layer_ids=[1], max_ngram_size=2, n_heads=1, head_dim=256, table_size=rows, compressed_vocab_size=1000
        )
    )


def pattern() -> np.ndarray:
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, (PATTERN_ROWS, ROW_BYTES), dtype=np.uint8)
    block[:, :256] &= 0x7E  # finite fp8 values
    return block


def expected(block: np.ndarray, ids: np.ndarray) -> torch.Tensor:
    """Rows `ids` as written: the pattern's row, its first 8 bytes the row index."""
    rows = block[ids % PATTERN_ROWS].copy()
    rows[:, :8] = ids.astype("<i8").view(np.uint8).reshape(-1, 8)
    return torch.from_numpy(rows)


def chunks(block: np.ndarray, n: int):
    for s in range(0, n, PATTERN_ROWS):  # whole tiles of the pattern: a slice, not a gather
        rows = block[: min(n, s + PATTERN_ROWS) - s].copy()
        rows[:, :8] = np.arange(s, s + len(rows), dtype="<i8").view(np.uint8).reshape(-1, 8)
        yield LayerRows("fp8_interleaved", torch.from_numpy(rows))


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def check_rows(got: torch.Tensor, block: np.ndarray, ids: np.ndarray) -> bool:
    return bool(torch.equal(got, expected(block, ids)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=32.0, help="table size (default 32)")
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/tmp"), help="where the table file is written")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for table_check_cost.json")
    ap.add_argument("--repeats", type=int, default=3, help="timed loads / batches per variant (default 3)")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per cold disk batch (default 16384)")
    ap.add_argument("--budget-s", type=float, default=210.0, help="skip further repeats past this (default 210)")
    args = ap.parse_args()
    if not native.available():
        raise SystemExit(f"the native library is needed (CRC32C, checked reads): {native.build().reason}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "bench": "table_check_cost",
        "machine": machine_info(),
        "args": vars(args),
        "crc32c_hardware": native.crc32c_hardware(),
        "threads": integrity.default_threads(),
    }
    path = Path(args.dir) / f"table_check_cost.{os.getpid()}.safetensors"
    block = pattern()
    probe = np.random.default_rng(1).integers(0, 256, 256 << 20, dtype=np.uint8)
    t = time.perf_counter()
    native.crc32c_blocks(probe, 4096, 4096)
    result["crc32c_gbps_one_thread"] = probe.nbytes / (time.perf_counter() - t) / 1e9
    del probe
    try:
        layout = layout_for(args.gib)
        n = layout.num_embeddings[0]
        nbytes = n * ROW_BYTES
        log(f"writing {nbytes / 2**30:.1f} GiB ({n:,} rows) to {path}")
        t = time.perf_counter()
        write_table_file(path, layout, "fp8_interleaved", {1: chunks(block, n)})
        result["write"] = {
            "gib": nbytes / 2**30,
            "rows": n,
            "s": time.perf_counter() - t,
            "gbps": nbytes / (time.perf_counter() - t) / 1e9,
        }
        log(f"written at {result['write']['gbps']:.2f} GB/s (CRCs and fsync included)")
        table = EngramTableFile(path, layout=layout)
        source = table.source(1)
        gen = np.random.default_rng(2)
        sample = np.sort(gen.integers(0, n, 65536))

        # ---- host tier: fill from the page cache, checked vs not, alternated
        host = {"checked": [], "unchecked": [], "rows_equal": True}
        for rep in range(args.repeats):
            for checked in (False, True) if rep % 2 == 0 else (True, False):
                if rep and time.perf_counter() - T0 > args.budget_s * 0.35:
                    break
                buf = allocate_host(nbytes, "mmap_register")
                raw = buf.tensor.view(n, ROW_BYTES)
                t = time.perf_counter()
                source.read(raw, checked=checked)
                dt = time.perf_counter() - t
                host["checked" if checked else "unchecked"].append(dt)
                host["rows_equal"] &= check_rows(raw[torch.from_numpy(sample)], block, sample)
                buf.close()
                log(f"host fill {'checked' if checked else 'unchecked'}: {dt:.2f} s ({nbytes / dt / 1e9:.1f} GB/s)")
        host["ratio"] = statistics.median(host["checked"]) / statistics.median(host["unchecked"])
        # ---- the mapped copy the host tier used before (no checks), from the page cache too, for reference
        weight = table.layer(1).weight
        t = time.perf_counter()
        store = place_layer(LayerRows("fp8_interleaved", weight), "host", progress=False)
        host["mapped_copy_s"] = time.perf_counter() - t
        store.close()
        release_pages(weight)  # unmapped, so that the disk phase can drop the file's pages
        del weight
        log(f"host mapped copy (the tier before: no checks): {host['mapped_copy_s']:.2f} s")
        t = time.perf_counter()
        store = place_layer(table.layer(1), "host", progress=False)
        host["place_layer_s"] = time.perf_counter() - t
        host["place_layer_pinned"] = bool(store._buffer is not None and store._buffer.pinned)
        host["rows_equal"] &= check_rows(store.raw[torch.from_numpy(sample)], block, sample)
        store.close()
        log(f"host place_layer (checked, page-locking included): {host['place_layer_s']:.2f} s")
        result["host"] = host

        # ---- disk tier: cold 16K-token batches, checked vs not, O_DIRECT and buffered
        disk = {}
        ids_n = args.tokens * N_COLS
        for direct in (True, False):
            key = "direct" if direct else "buffered"
            try:
                readers = {
                    True: source.reader(direct=direct)["weight"],
                    False: DirectRowReader(
                        path, source.spans["weight"][1], ROW_BYTES, n, direct=direct, identity=table.header.identity
                    ),
                }
            except StorageError as exc:
                disk[key] = {"error": str(exc)}
                continue
            d = {"checked_s": [], "unchecked_s": [], "rows_equal": True, "ids": ids_n}
            for rep in range(args.repeats):
                for checked in (False, True) if rep % 2 == 0 else (True, False):
                    if rep and time.perf_counter() - T0 > args.budget_s * 0.85:
                        break
                    ids = gen.integers(0, n, ids_n)
                    drop_cache(path)
                    t = time.perf_counter()
                    got = readers[checked].read(torch.from_numpy(ids))
                    dt = time.perf_counter() - t
                    d["checked_s" if checked else "unchecked_s"].append(dt)
                    pick = gen.integers(0, ids_n, 4096)
                    d["rows_equal"] &= check_rows(got[torch.from_numpy(pick)], block, ids[pick])
                    log(
                        f"disk {key} cold {'checked' if checked else 'unchecked'}: {dt:.2f} s "
                        f"({len(np.unique(ids)) / dt:,.0f} rows/s)"
                    )
            d["unique_rows"] = len(np.unique(ids))
            d["ratio"] = statistics.median(d["checked_s"]) / statistics.median(d["unchecked_s"])
            d["rows_per_s_checked"] = d["unique_rows"] / statistics.median(d["checked_s"])
            d["rows_per_s_unchecked"] = d["unique_rows"] / statistics.median(d["unchecked_s"])
            if not direct:  # the same ids again, from the page cache: the CPU cost alone
                warm = {}
                for checked in (False, True, False, True):
                    t = time.perf_counter()
                    readers[checked].read(torch.from_numpy(ids))
                    warm.setdefault(checked, []).append(time.perf_counter() - t)
                d["warm_checked_s"], d["warm_unchecked_s"] = min(warm[True]), min(warm[False])
                d["warm_ratio"] = d["warm_checked_s"] / d["warm_unchecked_s"]
            for r in readers.values():
                r.close()
            disk[key] = d
        result["disk"] = disk

        # ---- negative control: one flipped byte is refused by both tiers
        row = int(gen.integers(1000, n - 1000))
        with open(path, "r+b") as fh:
            pos = source.spans["weight"][1] + row * ROW_BYTES + 100
            fh.seek(pos)
            b = fh.read(1)[0]
            fh.seek(pos)
            fh.write(bytes([b ^ 0x10]))
        del table, source
        fresh = EngramTableFile(path).source(1)
        control = {}
        try:
            fresh.slice(row - 1000, row + 1000).read(torch.empty(2000, ROW_BYTES, dtype=torch.uint8))
            control["host"] = "SERVED"
        except integrity.IntegrityMismatch as exc:
            control["host"] = f"refused: {exc}"
        reader = fresh.reader(direct=False)["weight"]
        try:
            reader.read(torch.tensor([row]))
            control["disk"] = "SERVED"
        except StorageError as exc:
            control["disk"] = f"refused: {exc}"
        reader.close()
        result["negative_control"] = control
    finally:
        path.unlink(missing_ok=True)
    result["total_s"] = time.perf_counter() - T0
    (out_dir / "table_check_cost.json").write_text(json.dumps(result, indent=1))

    h, dk = result["host"], result["disk"]
    ok = (
        h["rows_equal"]
        and all(v.get("rows_equal", False) for v in dk.values())
        and all(v.startswith("refused") for v in result["negative_control"].values())
    )
    print(
        f"\ntable_check_cost: {result['write']['gib']:.1f} GiB table, {result['threads']} threads, CRC32C "
        f"{'SSE4.2' if result['crc32c_hardware'] else 'table'} {result['crc32c_gbps_one_thread']:.1f} GB/s/thread; "
        f"rows exact and damage refused: {ok}"
    )
    print(f"{'what':<44}{'checked':>10}{'unchecked':>11}{'ratio':>8}")
    print(
        f"{'host load from page cache (s, median)':<44}{statistics.median(h['checked']):>10.2f}"
        f"{statistics.median(h['unchecked']):>11.2f}{h['ratio']:>8.3f}"
    )
    for key, d in dk.items():
        if "error" in d:
            print(f"disk {key}: {d['error']}")
            continue
        label = f"disk {key} cold {args.tokens // 1024}K-token batch (s, median)"
        print(
            f"{label:<44}{statistics.median(d['checked_s']):>10.2f}"
            f"{statistics.median(d['unchecked_s']):>11.2f}{d['ratio']:>8.3f}"
        )
        if "warm_ratio" in d:
            print(
                f"{'disk buffered, same batch warm (s, best)':<44}{d['warm_checked_s']:>10.3f}"
                f"{d['warm_unchecked_s']:>11.3f}{d['warm_ratio']:>8.3f}"
            )
    print(
        f"host place_layer (checked, pinned {h['place_layer_pinned']}): {h['place_layer_s']:.2f} s; "
        f"the tier's mapped copy before (unchecked): {h['mapped_copy_s']:.2f} s; total {result['total_s']:.0f} s"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
