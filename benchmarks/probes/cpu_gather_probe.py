"""Probe: what bounds the CPU row gather of the host tier on this machine (GPU machine; run by
``scripts/gpu_cpu_gather_probe.sh``).

The lookup engine's CPU share is gathered by `condmem.native` (gather.c: OpenMP, software
prefetch a fixed distance ahead). On the H200 it reaches ~60-70M rows/s beside the DMAs; the
issue's targets need ~2x that. This probe measures, on a 64 GiB page-locked table of 264 B
rows, the gather's rate against: the span of the ids (address translation: a rate that
falls with the span is translation-bound), the thread count, the prefetch distance and
hint, non-temporal stores into the staging buffer, sorted vs unsorted ids, and
concurrent DMA / zero-copy traffic; and the machine's sequential copy bandwidth as a
ceiling. Variants are compiled from one C source with macros. Writes JSON to $OUT.
"""

# ruff: noqa: B023 - every closure below is called within its loop iteration (by `median`)
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
            /* the hint must be a constant: 3 = T0 (every level), 2 = T1 (L2 and out), 1 = T2, 0 = NTA */
            if (hint == 3) {
                for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(ahead + off, 0, 3);
            } else if (hint == 2) {
                for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(ahead + off, 0, 2);
            } else if (hint == 1) {
                for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(ahead + off, 0, 1);
            } else {
                for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(ahead + off, 0, 0);
            }
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
    subprocess.run(
        ["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(tmp / "g.c"), "-o", str(tmp / "g.so")],
        check=True,
    )
    lib = ctypes.CDLL(str(tmp / "g.so"))
    lib.gather.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.copy_par.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return lib


def launch_costs() -> list[dict]:
    """F. Host-side cost of the CUDA calls a lookup makes, on this machine (microseconds per call)."""
    results = []
    stream = torch.cuda.Stream()
    maps = Path("/proc/self/maps").read_text()
    cudart_path = next((line.split()[-1] for line in maps.splitlines() if "libcudart" in line), None)
    cudart = ctypes.CDLL(cudart_path) if cudart_path else None
    if cudart is not None:
        cudart.cudaMemcpyAsync.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
    print("cudart:", cudart_path, flush=True)

    def per_call(name, fn, calls=50, **extra):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - t) / calls
        torch.cuda.synchronize()
        results.append({"name": name, "us_per_call": host * 1e6, **extra})
        print(f"F {name:50s} {host * 1e6:8.1f} us/call {extra if extra else ''}", flush=True)

    for nbytes in (4096, 2 << 20, 34 << 20):
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

        def torch_copy():
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)

        per_call("torch copy_ pinned -> device (non_blocking)", torch_copy, calls=20, bytes=nbytes)
        if cudart is not None:
            per_call(
                "cudaMemcpyAsync (ctypes)",
                lambda: cudart.cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), nbytes, 1, stream.cuda_stream),
                calls=20,
                bytes=nbytes,
            )
    small = torch.zeros(16, device="cuda")
    per_call("tiny kernel (add_)", lambda: small.add_(1))
    per_call("torch.cuda.Event() + record", lambda: torch.cuda.Event().record(stream))
    ev = torch.cuda.Event()
    ev.record(stream)
    torch.cuda.synchronize()
    per_call("event.synchronize (done)", ev.synchronize)
    per_call("event.query (done)", ev.query)
    per_call("stream.wait_event", lambda: stream.wait_event(ev))
    per_call("torch.empty on cuda (4 MB)", lambda: torch.empty(1 << 22, dtype=torch.uint8, device="cuda"))
    g = torch.cuda.CUDAGraph()
    x = torch.zeros(1024, device="cuda")
    with torch.cuda.graph(g):
        for _ in range(20):
            x.add_(1)
    per_call("graph replay (20 kernels)", g.replay)
    per_call("host tensor .tolist() (8 ints)", lambda: torch.arange(8).tolist())
    return results


def sh(cmd: str) -> str:
    return subprocess.run(cmd, check=False, shell=True, capture_output=True, text=True).stdout.strip()


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "/tmp/probe"))
    out_dir.mkdir(parents=True, exist_ok=True)
    info = {
        "lscpu": sh("lscpu | head -30"),
        "thp": sh("cat /sys/kernel/mm/transparent_hugepage/enabled"),
        "nproc": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "meminfo": sh("grep -E 'MemTotal|AnonHuge|Hugepagesize' /proc/meminfo"),
    }
    print(info["lscpu"], "\n", info["thp"], "\n", info["meminfo"], flush=True)
    lib = build()
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 64.0
    parts = sys.argv[2] if len(sys.argv) > 2 else "ABCDS"  # which parts to run (also E, F, G, I, P)
    rows = int(gib * 2**30) // ROW
    from condmem.bench.lookup_setup import host_store

    if set(parts) <= {"F"}:
        results = launch_costs()
        (out_dir / "cpu_gather_probe.json").write_text(json.dumps({"info": info, "results": results}, indent=1))
        return
    store = host_store(rows, "mmap_register")  # random rows, page-locked; keeps the mapping alive
    table = store.raw
    print(f"table {gib} GiB: {tuple(table.shape)}", flush=True)
    n = 131072
    gen = torch.Generator().manual_seed(0)
    results = []
    # Fresh ids for every call (a row read twice may still be in the 300 MiB L3).
    pool = [torch.randint(0, rows, (393216,), generator=gen).sort().values for _ in range(16)]
    turn = [0]

    def fresh(k):
        turn[0] += 1
        ids = pool[turn[0] % len(pool)]
        step = max(1, ids.numel() // k)
        return ids[::step][:k].contiguous()  # a sorted uniform subset of k ids

    def median(fn, reps=7):
        times = []
        for _ in range(reps):
            args = fn()  # set-up, untimed; returns the timed callable
            torch.cuda.synchronize()
            t = time.perf_counter()
            args()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        times.sort()
        return times[len(times) // 2]

    def record(name, k, sec, **extra):
        row = {
            "name": name,
            "rows": k,
            "ms": sec * 1e3,
            "mrows_s": k / sec / 1e6,
            "x_h2d": k * ROW / sec / 1e9 / h2d,
            **extra,
        }
        results.append(row)
        print(
            f"{name:44s} {k:7d} rows: {sec * 1e3:6.3f} ms {k / sec / 1e6:6.1f} Mrows/s "
            f"{row['x_h2d']:.2f}x H2D  {extra if extra else ''}",
            flush=True,
        )

    from condmem.bench.lookup_setup import h2d_bandwidth_gbps
    from condmem.tables.lookup_plan import move_rows

    h2d = h2d_bandwidth_gbps()
    print(f"H2D {h2d:.1f} GB/s", flush=True)
    ring_bufs = [torch.empty((n, ROW), dtype=torch.uint8, pin_memory=True) for _ in range(3)]
    ring_i = [0]

    def gather_call(k, threads=15, pf=12, hint=0, nt=0, ring=False):
        ids = fresh(k)
        if ring:
            ring_i[0] += 1
        dst = ring_bufs[ring_i[0] % 3]
        return lambda: lib.gather(table.data_ptr(), ROW, ids.data_ptr(), k, dst.data_ptr(), threads, pf, hint, nt)

    if "A" in parts:
        # A. The bare gather of one 131072-row chunk.
        median(lambda: gather_call(n))
        for pf in (4, 8, 12, 16):
            for hint in (0, 3):
                record("A gather", n, median(lambda: gather_call(n, pf=pf, hint=hint)), pf=pf, hint=hint)
        record("A gather, ring of 3 dst", n, median(lambda: gather_call(n, ring=True)), pf=12, hint=0)
        record("A gather, ring of 3 dst, NT stores", n, median(lambda: gather_call(n, ring=True, nt=1)), nt=1)

        def unsorted_call():
            ids = fresh(n)[torch.randperm(n)].contiguous()
            return lambda: lib.gather(table.data_ptr(), ROW, ids.data_ptr(), n, ring_bufs[0].data_ptr(), 15, 12, 0, 0)

        record("A gather, unsorted ids", n, median(unsorted_call))
        for threads in (8, 12, 16):
            record("A gather, threads", n, median(lambda: gather_call(n, threads=threads)), threads=threads)

    if "P" in parts:
        # P. The prefetch hint and distance of the bare gather, alone and beside a DMA (the send's
        # situation). T0 fills L1 and each core has few L1 fill buffers (~16 lines: ~3 rows of
        # 264 B in flight); T1/T2 stop at L2, which tracks more misses: if the gather is bound
        # by misses in flight per core, T1 and a longer distance win.
        big = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        big_dev = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        dma_stream = torch.cuda.Stream()

        def timed_beside(k, pf, hint, reps=7):
            """Median seconds of the gather alone, started just after a 1 GiB H2D copy (~19 ms,
            longer than the gather) was queued."""
            times = []
            for _ in range(reps):
                run = gather_call(k, pf=pf, hint=hint, ring=True)
                torch.cuda.synchronize()
                with torch.cuda.stream(dma_stream):
                    big_dev.copy_(big, non_blocking=True)
                time.sleep(0.001)  # the DMA under way
                t = time.perf_counter()
                run()
                times.append(time.perf_counter() - t)
                dma_stream.synchronize()
            times.sort()
            return times[len(times) // 2]

        median(lambda: gather_call(n))
        for _ in range(2):  # twice: the spread between rounds is the noise
            for hint in (3, 2, 1):
                for pf in (8, 12, 16, 24, 32):
                    record("P gather", n, median(lambda: gather_call(n, pf=pf, hint=hint, ring=True)), pf=pf, hint=hint)
            for hint, pf in ((3, 12), (2, 16), (2, 24), (1, 24)):
                record("P gather beside a DMA (gather timed)", n, timed_beside(n, pf, hint), pf=pf, hint=hint)

    # B. The engine's CPU path, emulated: chunks gathered into a ring of pinned buffers,
    # each DMA'd to the device (copy stream) while the next is gathered.
    copy_stream = torch.cuda.Stream()
    dev_rows = torch.empty((393216, ROW), dtype=torch.uint8, device="cuda")

    steps = {"gather": 0.0, "dma launch": 0.0, "ring wait": 0.0}

    def cpu_path(k, chunk, threads=15, pf=12, hint=0, nt=0, gather=True, dma=True):
        ids = fresh(k)
        bufs = [torch.empty((chunk, ROW), dtype=torch.uint8, pin_memory=True) for _ in range(3)]
        free = [None] * 3

        def go():
            for j, s0 in enumerate(range(0, k, chunk)):
                e0 = min(k, s0 + chunk)
                b = j % 3
                t0 = time.perf_counter()
                if free[b] is not None:
                    free[b].synchronize()
                t1 = time.perf_counter()
                if gather:
                    lib.gather(
                        table.data_ptr(), ROW, ids[s0:].data_ptr(), e0 - s0, bufs[b].data_ptr(), threads, pf, hint, nt
                    )
                t2 = time.perf_counter()
                if dma:
                    with torch.cuda.stream(copy_stream):
                        dev_rows[s0:e0].copy_(bufs[b][: e0 - s0], non_blocking=True)
                        free[b] = torch.cuda.Event()
                        free[b].record(copy_stream)
                t3 = time.perf_counter()
                steps["ring wait"] += t1 - t0
                steps["gather"] += t2 - t1
                steps["dma launch"] += t3 - t2
            copy_stream.synchronize()

        return go

    def zero_copy(k):
        ids = fresh(k).cuda()
        return lambda: move_rows(table, ids, zc_out, zc_dst[:k])

    zc_out = torch.empty((393216, ROW), dtype=torch.uint8, device="cuda")
    zc_dst = torch.arange(393216, device="cuda")
    side = torch.cuda.Stream()

    def split_call(cpu_setup, kc):
        """A 393216-row batch split as the engine does: `cpu_setup()`'s CPU path for kc rows,
        the zero-copy kernel (on a side stream) for the rest, timed together."""
        cpu = cpu_setup()
        zc = zero_copy(393216 - kc)

        def go():
            with torch.cuda.stream(side):
                zc()
            cpu()
            side.synchronize()

        return go

    if "E" in parts:
        # E. Where a chunk's time goes: gather-only and DMA-only rings, then the pipeline's steps.
        for chunk in (8192, 32768, 131072):
            record("E gather only (ring)", 393216, median(lambda: cpu_path(393216, chunk, dma=False)), chunk=chunk)
            record("E DMA only (ring)", 393216, median(lambda: cpu_path(393216, chunk, gather=False)), chunk=chunk)
            for key in steps:
                steps[key] = 0.0
            sec = median(lambda: cpu_path(393216, chunk))
            record(
                "E pipeline",
                393216,
                sec,
                chunk=chunk,
                **{f"{key} ms/call": round(v / 7 * 1e3, 3) for key, v in steps.items()},
            )

    if "G" in parts:
        # G. The staged sender (condmem.tables.staged_transfer): native (one parallel region,
        # direct cudaMemcpyAsync) by chunk size, against its torch loop; then beside zero-copy.
        from condmem.tables.staged_transfer import StagedSender

        senders = {}

        def staged(k, chunk, native=True, ring=4, threads=15):
            key = (chunk, native, ring)
            if key not in senders:
                senders[key] = StagedSender(ROW, "cuda", chunk_rows=chunk, ring=ring)
                senders[key].native = senders[key].native and native  # False: the torch loop
            sender, ids = senders[key], fresh(k)

            def go():
                sender.send(store, ids, dev_rows[:k], copy_stream, threads=threads)
                copy_stream.synchronize()

            return go

        for k in (105000, 393216):
            record("G torch loop (chunk 131072, ring 3)", k, median(lambda: staged(k, 131072, False, 3)))
            for chunk in (8192, 16384, 32768, 65536, 131072):
                record("G native send", k, median(lambda: staged(k, chunk)), chunk=chunk)
            record("G native send, 16 threads", k, median(lambda: staged(k, 65536, threads=16)), chunk=65536)
            record("G native send, ring 8", k, median(lambda: staged(k, 16384, ring=8)), chunk=16384)
        median(lambda: zero_copy(1024), reps=2)  # compile
        for f in (0.7, 0.8, 0.9):
            for chunk in (32768, 65536):
                kc = int(393216 * f)
                record(
                    "G split: native send + zero-copy",
                    393216,
                    median(lambda: split_call(lambda: staged(kc, chunk), kc)),
                    f=f,
                    chunk=chunk,
                )

    if "I" in parts:
        # I. The native send (`condmem_gather_stream`: no team barriers, threads take 64-row
        # pieces in order, a chunk is sent as soon as it is whole), its chunks ramped from 4096
        # rows up to the chunk size and back (`chunk_bounds`) or all of the chunk size
        # ("fixed"); per-chunk times; beside zero-copy. (Against the barrier-per-chunk routine
        # it replaced: `docs/lookup-engine.md`.)
        from condmem.tables.staged_transfer import StagedSender

        senders = {}

        def sender_for(chunk, ring, ramp):
            key = (chunk, ring, ramp)
            if key not in senders:
                senders[key] = StagedSender(
                    ROW, "cuda", chunk_rows=chunk, ring=ring, **({} if ramp else {"tail_rows": chunk})
                )
            return senders[key]

        def streamed(k, chunk, ring=4, ramp=True, threads=15, per=None):
            sender, ids = sender_for(chunk, ring, ramp), fresh(k)
            sender.record_timeline = per is not None

            def go():
                sender.send(store, ids, dev_rows[:k], copy_stream, threads=threads)
                copy_stream.synchronize()
                if per is not None:
                    for key, v in sender.last_timeline.items():
                        per.setdefault(key, []).extend(v)

            return go

        for _ in range(2):  # twice: the spread between rounds is the noise
            for k in (105000, 393216):
                for chunk in (8192, 65536):
                    record("I native send, fixed", k, median(lambda: streamed(k, chunk, ramp=False)), chunk=chunk)
                for chunk in (16384, 32768, 65536, 131072):
                    record("I native send, ramped", k, median(lambda: streamed(k, chunk)), chunk=chunk)
                record("I native send, ramped, ring 8", k, median(lambda: streamed(k, 16384, ring=8)), chunk=16384)
                record(
                    "I native send, ramped, 16 threads", k, median(lambda: streamed(k, 65536, threads=16)), chunk=65536
                )
        for chunk in (8192, 65536):
            per = {}
            sec = median(lambda: streamed(393216, chunk, ramp=False, per=per))
            record(
                "I native send, fixed, per chunk (us)",
                393216,
                sec,
                chunk=chunk,
                **{f"{key} us": round(sum(v) / len(v), 1) for key, v in per.items()},
            )
        median(lambda: zero_copy(1024), reps=2)  # compile
        for f in (0.7, 0.8, 0.9):
            kc = int(393216 * f)
            record(
                "I split: native send (ramped) + zero-copy",
                393216,
                median(lambda: split_call(lambda: streamed(kc, 65536), kc)),
                f=f,
                chunk=65536,
            )

    if "B" in parts:
        for k in (105000, 275000, 393216):
            for chunk in (8192, 16384, 32768, 65536, 131072):
                record("B cpu path (gather + DMA ring)", k, median(lambda: cpu_path(k, chunk)), chunk=chunk)
        for hint, nt in ((3, 0), (0, 1)):
            record(
                "B cpu path",
                393216,
                median(lambda: cpu_path(393216, 32768, hint=hint, nt=nt)),
                chunk=32768,
                hint=hint,
                nt=nt,
            )

    if "C" in parts:
        # C. GPU zero-copy of sorted uniform rows, warm.
        median(lambda: zero_copy(1024), reps=2)  # compile
        for k in (32768, 118000, 393216):
            record("C zero-copy (GPU reads host rows)", k, median(lambda: zero_copy(k)))

    if "D" in parts:
        # D. Both at once, as the engine splits: CPU path for f of the rows, zero-copy the rest.
        for f in (0.6, 0.7, 0.8):
            for chunk in (16384, 32768, 131072):
                kc = int(393216 * f)
                record(
                    "D split: cpu path + zero-copy",
                    393216,
                    median(lambda: split_call(lambda: cpu_path(kc, chunk), kc)),
                    f=f,
                    chunk=chunk,
                )

    if "S" in parts:
        a = torch.empty(1 << 30, dtype=torch.uint8)
        big = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        a.fill_(1)
        big.fill_(2)
        for threads in (8, 15):
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
