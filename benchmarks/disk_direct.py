"""The disk tier's cold reads against the disk's own random-read rate, measured in one run.

1. Probe: random aligned 4 KiB reads with O_DIRECT (`DirectRowReader` with 4 KiB rows), the
   rate the device allows at this queue depth.
2. Direct rows: fresh uniform ids every batch (16K tokens x 24 columns of 264 B rows), read
   with O_DIRECT: rows/s and their ratio to the probe.
3. Mapped rows, page cache dropped before each batch: what the mapped disk tier costs cold.

    PYTHONPATH=src python3 benchmarks/disk_direct.py --dir /path/on/the/disk --gib 4 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from condmem.tables.direct_read import DirectRowReader

ROW = 264


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def make_file(path: Path, nbytes: int) -> None:
    if path.exists() and path.stat().st_size == nbytes:
        return
    block = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8).numpy().tobytes()
    with open(path, "wb") as fh:
        left = nbytes
        while left:
            n = min(left, len(block))
            fh.write(block[:n])
            left -= n
        fh.flush()
        os.fsync(fh.fileno())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=".")
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--threads", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    path = Path(args.dir) / "condmem-disk-bench.bin"
    nbytes = int(args.gib * 2**30) // 4096 * 4096
    make_file(path, nbytes)
    rows_total = nbytes // ROW
    gen = torch.Generator().manual_seed(0)
    result = {"date": time.strftime("%Y-%m-%d"), "file_gib": nbytes / 2**30, "row_bytes": ROW, "runs": []}
    for threads in args.threads:
        probe = DirectRowReader(path, 0, 4096, nbytes // 4096, threads=threads)
        ids = torch.randint(0, nbytes // 4096, (100_000,), generator=gen)
        drop_cache(path)
        t0 = time.perf_counter()
        probe.read(ids)
        probe_rate = ids.unique().numel() / (time.perf_counter() - t0)
        probe.close()
        reader = DirectRowReader(path, 0, ROW, rows_total, threads=threads)
        direct = []
        for _ in range(args.batches):
            ids = torch.randint(0, rows_total, (16384 * 24,), generator=gen)
            drop_cache(path)
            t0 = time.perf_counter()
            reader.read(ids)
            direct.append(ids.unique().numel() / (time.perf_counter() - t0))
        reader.close()
        run = {"threads": threads, "probe_4k_reads_per_s": probe_rate,
               "direct_rows_per_s": statistics.median(direct), "direct_vs_probe": statistics.median(direct) / probe_rate}
        result["runs"].append(run)
        print(run, flush=True)
    # Mapped, cold: the page cache's read-around on every miss.
    import mmap

    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), rows_total * ROW, access=mmap.ACCESS_READ)
    if hasattr(mm, "madvise"):
        mm.madvise(mmap.MADV_RANDOM)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        table = torch.frombuffer(mm, dtype=torch.uint8).view(rows_total, ROW)
    ids = torch.randint(0, rows_total, (16384 * 24 // 8,), generator=gen)
    drop_cache(path)
    t0 = time.perf_counter()
    table.index_select(0, ids)
    result["mapped_cold_rows_per_s"] = ids.unique().numel() / (time.perf_counter() - t0)
    del table
    mm.close()
    print({"mapped_cold_rows_per_s": result["mapped_cold_rows_per_s"]})
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "disk_direct.json").write_text(json.dumps(result, indent=1) + "\n")
    path.unlink()


if __name__ == "__main__":
    main()
