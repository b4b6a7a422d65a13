"""A native CPU row gather with software prefetch, compiled on first use (gcc + OpenMP, via ctypes).

Random reads of 264 B rows from a table of tens of GiB are bound by memory latency: a
plain copy loop (torch's `index_select`) stalls on every row, since the next address is
unknown to the hardware prefetcher. Here each thread prefetches the row a few
iterations ahead while it copies the current one, so many misses are in flight at once.

The C source below is compiled once per machine into ``$CONDMEM_CACHE_DIR/native``
(keyed by its hash) and loaded with ctypes, which releases the GIL during the call. If
no C compiler is present (or ``CONDMEM_NATIVE=0``), `native_gather_rows` returns None
and callers fall back to `torch.index_select` with a logged notice.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("condmem.tables")

PREFETCH_DISTANCE = 12

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <time.h>

/* Row i of dst <- row ids[i] of src. The row PF ahead is prefetched (into every cache level:
   measured on the H200's host, hint T0 beat NTA by ~10%). */
static inline void copy_row(const uint8_t *src, int64_t row_bytes, const int64_t *ids, int64_t i, int64_t n,
                            uint8_t *dst_row) {
    if (i + PF < n) {
        const uint8_t *ahead = src + ids[i + PF] * row_bytes;
        for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(ahead + off, 0, 3);
    }
    memcpy(dst_row, src + ids[i] * row_bytes, (size_t)row_bytes);
}

/* Copy rows ids[0..n) of `row_bytes` each from src to dst (dst row i <- src row ids[i]).
   Dynamic chunks of rows: a thread that shares its core (with a thread spinning on a GPU
   sync, say) must not hold back the whole team, as a static split would. */
void condmem_gather_rows(const uint8_t *src, int64_t row_bytes, const int64_t *ids, int64_t n,
                         uint8_t *dst, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 256)
    for (int64_t i = 0; i < n; i++) copy_row(src, row_bytes, ids, i, n, dst + i * row_bytes);
}

/* The CUDA runtime calls the staged send makes, passed in as pointers (so this file needs no
   CUDA headers, and tests can pass host stand-ins). Each returns 0 on success. */
typedef int (*memcpy_async_fn)(void *dst, const void *src, size_t bytes, int kind, void *stream);
typedef int (*event_record_fn)(void *event, void *stream);
typedef int (*event_sync_fn)(void *event);

/* Gather rows ids[0..n) into a ring of staging buffers, `chunk_rows` rows at a time, and send
   each chunk to dst (row i -> dst + i * row_bytes) with memcpy_async on `stream` as soon as it
   is gathered, while the team gathers the next chunk. Chunk c uses ring buffer
   (ring_start + c) % ring_len, after waiting for that buffer's event (its last send), and
   records the event after its own send.

   One parallel region for the whole share: no thread-team start per chunk, so chunks can be
   small enough to stay in the caches (the send then reads them there, not from DRAM). Only
   the calling thread (OpenMP's master: the one whose CUDA device is set) calls the runtime.
   `timeline` (NULL: none): 1 + 3 * n_chunks int64 entries, nanoseconds on CLOCK_MONOTONIC:
   the start, then per chunk when its buffer was free (all threads past the wait), when it
   was gathered, and when its send was queued.
   Returns 0, or the first nonzero code a runtime call returned (nothing after it is sent). */
static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

int condmem_gather_send(const uint8_t *src, int64_t row_bytes, const int64_t *ids, int64_t n,
                        uint8_t *const *ring, void *const *ring_events, int ring_len, int ring_start,
                        int64_t chunk_rows, uint8_t *dst, void *stream, memcpy_async_fn memcpy_async,
                        event_record_fn record, event_sync_fn sync, int nthreads, int64_t *timeline) {
    int err = 0;
    int64_t n_chunks = (n + chunk_rows - 1) / chunk_rows;
    if (timeline) timeline[0] = now_ns();
    #pragma omp parallel num_threads(nthreads)
    for (int64_t c = 0; c < n_chunks; c++) {
        int b = (int)((ring_start + c) % ring_len);
        int64_t s = c * chunk_rows, e = s + chunk_rows < n ? s + chunk_rows : n;
        #pragma omp master
        if (!err) err = sync(ring_events[b]);      /* buffer b's previous send has finished */
        #pragma omp barrier
        if (err) break;                            /* every thread sees it after the barrier */
        #pragma omp master
        if (timeline) timeline[1 + 3 * c] = now_ns();
        #pragma omp for schedule(dynamic, 256)
        for (int64_t i = s; i < e; i++) copy_row(src, row_bytes, ids, i, n, ring[b] + (i - s) * row_bytes);
        /* (the loop's implicit barrier: the chunk is whole) */
        #pragma omp master
        {
            if (timeline) timeline[2 + 3 * c] = now_ns();
            if (!err) err = memcpy_async(dst + s * row_bytes, ring[b], (size_t)((e - s) * row_bytes), 1, stream);
            if (!err) err = record(ring_events[b], stream);
            if (timeline) timeline[3 + 3 * c] = now_ns();
        }
    }
    return err;
}

/* Host stand-ins for the runtime calls (tests). `stream` and events point to int64 counters:
   stream[0] counts sends and the send numbered stream[1] (when > 0) fails with code 7;
   event[0] counts records, event[1] waits. */
int condmem_test_memcpy(void *dst, const void *src, size_t bytes, int kind, void *stream) {
    int64_t *counters = (int64_t *)stream;
    counters[0]++;
    if (counters[1] > 0 && counters[0] == counters[1]) return 7;
    memcpy(dst, src, bytes);
    return kind == 1 ? 0 : 9;
}
int condmem_test_skip_memcpy(void *dst, const void *src, size_t bytes, int kind, void *stream) {
    (void)dst; (void)src; (void)bytes; (void)stream;   /* probes: the gather without any send */
    return kind == 1 ? 0 : 9;
}
int condmem_test_record(void *event, void *stream) { (void)stream; ((int64_t *)event)[0]++; return 0; }
int condmem_test_sync(void *event) { ((int64_t *)event)[1]++; return 0; }
""".replace("PF", str(PREFETCH_DISTANCE))

_lock = threading.Lock()
_lib = None
_tried = False


def _cache_dir() -> Path:
    root = os.environ.get("CONDMEM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "condmem")
    return Path(root) / "native"


def _load():
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("CONDMEM_NATIVE", "1") == "0":
            log.info("native CPU gather disabled (CONDMEM_NATIVE=0): using torch.index_select")
            return None
        cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
        if cc is None:
            log.warning("no C compiler found: the CPU gather falls back to torch.index_select (slower on big tables)")
            return None
        digest = hashlib.sha256((_SOURCE + cc).encode()).hexdigest()[:16]
        target = _cache_dir() / f"gather-{digest}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory() as tmp:
                src = Path(tmp) / "gather.c"
                src.write_text(_SOURCE)
                out = Path(tmp) / "gather.so"
                cmd = [cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(out)]
                proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if proc.returncode != 0:
                    log.warning("compiling the native CPU gather failed (%s): falling back to torch.index_select",
                                proc.stderr.strip()[:300])
                    return None
                os.replace(out, target)  # atomic: concurrent processes see a whole file or none
        try:
            lib = ctypes.CDLL(str(target))
        except OSError as exc:
            log.warning("loading the native CPU gather failed (%s): falling back to torch.index_select", exc)
            return None
        lib.condmem_gather_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                            ctypes.c_void_p, ctypes.c_int]
        lib.condmem_gather_rows.restype = None
        lib.condmem_gather_send.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,     # src, row_bytes, ids, n
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,        # ring, events, ring_len, start
            ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,                     # chunk_rows, dst, stream
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,      # memcpy, record, sync, threads
            ctypes.c_void_p]                                                      # timeline (or None)
        lib.condmem_gather_send.restype = ctypes.c_int
        _lib = lib
        return lib


def runtime_stand_ins() -> dict[str, int]:
    """Addresses of the host stand-ins for the CUDA runtime calls of `condmem_gather_send`
    (``memcpy``, ``skip_memcpy``, ``record``, ``sync``: see the C source), for tests and probes
    that run the staged send without a GPU or without its copies."""
    lib = _load()
    if lib is None:
        raise RuntimeError("the native gather is unavailable (no C compiler?)")
    return {name: ctypes.cast(getattr(lib, f"condmem_test_{name}"), ctypes.c_void_p).value
            for name in ("memcpy", "skip_memcpy", "record", "sync")}


def available() -> bool:
    """True when the native gather compiled and loaded."""
    return _load() is not None


def native_gather_rows(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor,
                       threads: int | None = None) -> torch.Tensor | None:
    """Rows ``table[ids]`` into `out` (uint8 [n, row_bytes]); None when the native code is unavailable.

    `table` is uint8 [rows, row_bytes] on the CPU (any memory: pinned, mmap'd, plain);
    `ids` int64 on the CPU, all in range (callers check); `out` contiguous.
    """
    lib = _load()
    if lib is None:
        return None
    if table.dtype != torch.uint8 or table.dim() != 2 or not table.is_contiguous():
        raise ValueError("native gather needs a contiguous uint8 [rows, row_bytes] table")
    if out.shape != (ids.numel(), table.shape[1]) or not out.is_contiguous() or out.dtype != torch.uint8:
        raise ValueError(f"out must be contiguous uint8 [{ids.numel()}, {table.shape[1]}]")
    ids = ids.contiguous().to(torch.int64)
    n = ids.numel()
    if n:
        lib.condmem_gather_rows(table.data_ptr(), table.shape[1], ids.data_ptr(), n, out.data_ptr(),
                                int(threads or torch.get_num_threads()))
    return out
