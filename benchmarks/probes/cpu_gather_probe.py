"""Probe: what bounds the CPU row gather of the host tier on this machine (GPU machine; run by
``scripts/gpu_cpu_gather_probe.sh``).

The lookup engine's CPU share is gathered by `condmem.tables.native_gather` (OpenMP, software
prefetch a fixed distance ahead). On the H200 it reaches ~60-70M rows/s beside the DMAs; the
issue's targets need ~2x that. This probe measures, on a 64 GiB page-locked table of 264 B
rows, the gather's rate against: the span of the ids (address translation: a rate that
falls with the span is translation-bound), the thread count, the prefetch distance and
hint, non-temporal stores into the staging buffer, sorted vs unsorted ids, and
concurrent DMA / zero-copy traffic; and the machine's sequential copy bandwidth as a
ceiling. Variants are compiled from one C source with macros. Writes JSON to $OUT.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROW = 264
SRC = r"""
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
void gather(const uint8_t *src, int64_t row_bytes, const int64_t *ids, int64_t n, uint8_t *dst,
            int nthreads, int pf, int hint, int nt) {
    #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 256)
    for (int64_t i = 0; i < n; i++) {
        if (pf && i + pf < n) {
            const uint8_t *ahead = src + ids[i + pf] * row_bytes;
            if (hint == 3) { for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(ahead + off, 0, 3); }
            else { for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(ahead + off, 0, 0); }
        }
        const uint8_t *s = src + ids[i] * row_bytes;
        uint8_t *d = dst + i * row_bytes;
        if (nt) {
            for (int64_t off = 0; off < row_bytes; off += 8)
                _mm_stream_si64((long long *)(d + off), *(const long long *)(s + off));
        } else {
            memcpy(d, s, (size_t)row_bytes);
        }
    }
    if (nt) _mm_sfence();
}
void copy_par(const uint8_t *src, uint8_t *dst, int64_t n, int nthreads) {
    int64_t block = 1 << 20;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < (n + block - 1) / block; b++) {
        int64_t s = b * block, e = s + block < n ? s + block : n;
        memcpy(dst + s, src + s, (size_t)(e - s));
    }
}
"""


def build():
    tmp = Path(tempfile.mkdtemp())
    (tmp / "g.c").write_text(SRC)
    subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(tmp / "g.c"), "-o",
                    str(tmp / "g.so")], check=True)
    lib = ctypes.CDLL(str(tmp / "g.so"))
    lib.gather.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                           ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.copy_par.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return lib


def sh(cmd: str) -> str:
    return subprocess.run(cmd, check=False, shell=True, capture_output=True, text=True).stdout.strip()


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "/tmp/probe"))
    out_dir.mkdir(parents=True, exist_ok=True)
    info = {"lscpu": sh("lscpu | head -30"), "thp": sh("cat /sys/kernel/mm/transparent_hugepage/enabled"),
            "nproc": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "meminfo": sh("grep -E 'MemTotal|AnonHuge|Hugepagesize' /proc/meminfo")}
    print(info["lscpu"], "\n", info["thp"], "\n", info["meminfo"], flush=True)
    lib = build()
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 64.0
    rows = int(gib * 2**30) // ROW
    from condmem.bench.lookup_setup import host_store
    store = host_store(rows, "mmap_register")     # random rows, page-locked; keeps the mapping alive
    table = store.raw
    print(f"table {gib} GiB: {tuple(table.shape)}", flush=True)
    n = 131072
    dst = torch.empty((n, ROW), dtype=torch.uint8, pin_memory=True)
    gen = torch.Generator().manual_seed(0)
    results = []

    def ids_for(span_rows, sort=True, k=4):
        sets = []
        for _ in range(k):
            x = torch.randint(0, span_rows, (n,), generator=gen)
            sets.append(x.sort().values if sort else x)
        return sets

    def run(name, id_sets, threads=15, pf=12, hint=0, nt=0, before=None, reps=3, **extra):
        times = []
        for r in range(reps):
            for ids in id_sets:
                if before is not None:
                    before()
                t = time.perf_counter()
                lib.gather(table.data_ptr(), ROW, ids.data_ptr(), n, dst.data_ptr(), threads, pf, hint, nt)
                times.append(time.perf_counter() - t)
                torch.cuda.synchronize()
        times.sort()
        med = times[len(times) // 2]
        row = {"name": name, "threads": threads, "pf": pf, "hint": hint, "nt": nt, "ms": med * 1e3,
               "mrows_s": n / med / 1e6, **extra}
        results.append(row)
        print(f"{name:34s} thr {threads:2d} pf {pf:3d} hint {hint} nt {nt}: {med * 1e3:6.3f} ms "
              f"{n / med / 1e6:6.1f} Mrows/s", flush=True)

    full = ids_for(rows)
    run("warm", full)
    for span_gib in (0.25, 1, 4, 16, 64):
        span = min(rows, int(span_gib * 2**30) // ROW)
        run(f"span {span_gib} GiB", ids_for(span), span_gib=span_gib)
    for threads in (1, 4, 8, 12, 15, 16):
        run("threads", full, threads=threads)
    for pf in (0, 4, 8, 16, 24, 32, 48, 64):
        run("prefetch distance", full, pf=pf)
    for pf in (12, 32):
        run("hint T0", full, pf=pf, hint=3)
        run("non-temporal stores", full, pf=pf, nt=1)
    run("unsorted ids", ids_for(rows, sort=False))
    # Beside DMA: queue ~20 ms of H2D copies from another pinned buffer before each gather.
    big = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()

    def dma():
        with torch.cuda.stream(side):
            dev.copy_(big, non_blocking=True)
    run("beside 1 GiB H2D", full, before=dma)
    run("beside 1 GiB H2D, 16 thr", full, before=dma, threads=16)
    # Beside a zero-copy gather kernel of 4M uniform rows.
    try:
        from condmem.tables.lookup_plan import move_rows
        zc_n = 1 << 22
        zc_ids = torch.randint(0, rows, (zc_n,), device="cuda").sort().values
        zc_out = torch.empty((zc_n, ROW), dtype=torch.uint8, device="cuda")
        zc_dst = torch.arange(zc_n, device="cuda")

        def zero_copy():
            with torch.cuda.stream(side):   # the GPU reads the page-locked table in place
                move_rows(table, zc_ids, zc_out, zc_dst)
        torch.cuda.synchronize()
        t = time.perf_counter()
        zero_copy()
        torch.cuda.synchronize()
        zc_ms = (time.perf_counter() - t) * 1e3
        print(f"zero-copy 4M sorted rows alone: {zc_ms:.1f} ms ({(1 << 22) / zc_ms / 1e3:.1f} Mrows/s)", flush=True)
        results.append({"name": "zero-copy alone", "ms": zc_ms, "mrows_s": (1 << 22) / zc_ms / 1e3})
        run("beside zero-copy", full, before=zero_copy)
    except Exception as exc:  # noqa: BLE001 - a probe: report and go on
        print("zero-copy part failed:", exc)
    # Sequential copy ceiling (1 GiB pinned -> pageable), threads 15.
    a = torch.empty(1 << 30, dtype=torch.uint8)
    a.fill_(1)
    for threads in (1, 8, 15):
        times = []
        for _ in range(5):
            t = time.perf_counter()
            lib.copy_par(big.data_ptr(), a.data_ptr(), 1 << 30, threads)
            times.append(time.perf_counter() - t)
        times.sort()
        gbps = (1 << 30) / times[2] / 1e9
        results.append({"name": "sequential copy", "threads": threads, "gb_s": gbps})
        print(f"sequential copy 1 GiB, {threads} threads: {gbps:.1f} GB/s (read) ", flush=True)
    (out_dir / "cpu_gather_probe.json").write_text(json.dumps({"info": info, "results": results}, indent=1))


if __name__ == "__main__":
    main()
