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
#include <stdlib.h>
#include <omp.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() do { } while (0)
#endif

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
   CUDA headers, and tests can pass host stand-ins). Each returns 0 on success; `query`
   returns 0 (done), NOT_READY (cudaErrorNotReady) or an error code. */
typedef int (*memcpy_async_fn)(void *dst, const void *src, size_t bytes, int kind, void *stream);
typedef int (*event_record_fn)(void *event, void *stream);
typedef int (*event_query_fn)(void *event);
#define NOT_READY 600
#define PIECE 64

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* The staged send: rows ids[bounds[0]..bounds[n_chunks]) gathered into a ring of staging
   buffers and sent to dst (row i -> dst + i * row_bytes) with memcpy_async on `stream`, chunk
   by chunk; chunk c is rows [bounds[c], bounds[c+1]) (at most a ring buffer) and uses buffer
   (ring_start + c) % ring_len, written once `query` says that buffer's last send (its event)
   is done, and its event is recorded after its own send.

   One OpenMP region for the whole share and no team barriers: threads take pieces of up to
   PIECE rows in order from one shared counter and gather them into the ring; the calling
   thread (thread 0, the one whose CUDA device is set) queues a chunk's send as soon as every
   piece of it is in, and marks a buffer writable again once its query says done (it polls:
   nothing blocks it). While it has nothing to queue or free it gathers pieces too, but only
   of chunks already writable, since it is the one that frees the rest. No thread waits for
   the slowest piece of a chunk, so chunks cost little each and a send can start and end in
   small ones (measured on the H200: a barrier per chunk cost 0.4 ms of a 1.4 ms send of
   105K rows).

   `timeline` (NULL: none): 1 + 3 * n_chunks int64, nanoseconds on CLOCK_MONOTONIC: the
   start, then per chunk when its buffer became writable, when its last piece was in (as the
   sender saw it), when its send was queued.
   Returns 0, or the first nonzero code a runtime call returned (nothing after it is sent). */
static inline void gather_piece(const uint8_t *src, int64_t row_bytes, const int64_t *ids, int64_t s, int64_t e,
                                uint8_t *dst) {
    for (int64_t i = s; i < e && i < s + PF; i++) {       /* the first rows: nobody prefetched them */
        const uint8_t *row = src + ids[i] * row_bytes;
        for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(row + off, 0, 3);
    }
    for (int64_t i = s; i < e; i++) copy_row(src, row_bytes, ids, i, e, dst + (i - s) * row_bytes);
}

int condmem_gather_stream(const uint8_t *src, int64_t row_bytes, const int64_t *ids,
                          uint8_t *const *ring, void *const *ring_events, int ring_len, int ring_start,
                          const int64_t *bounds, int64_t n_chunks, uint8_t *dst, void *stream,
                          memcpy_async_fn memcpy_async, event_record_fn record, event_query_fn query,
                          int nthreads, int64_t *timeline) {
    if (n_chunks <= 0) return 0;
    int64_t n_pieces = 0;
    for (int64_t c = 0; c < n_chunks; c++) n_pieces += (bounds[c + 1] - bounds[c] + PIECE - 1) / PIECE;
    /* rows in, per chunk; then each piece's first row and chunk */
    int64_t *done = (int64_t *)calloc((size_t)(n_chunks + 2 * n_pieces + 1), sizeof(int64_t));
    if (!done) return 2;                                                     /* cudaErrorMemoryAllocation */
    int64_t *piece_start = done + n_chunks, *piece_chunk = piece_start + n_pieces;
    for (int64_t c = 0, k = 0; c < n_chunks; c++)
        for (int64_t r = bounds[c]; r < bounds[c + 1]; r += PIECE, k++) { piece_start[k] = r; piece_chunk[k] = c; }
    int64_t next_piece = 0, writable = 0;  /* pieces handed out; chunks [0, writable) may be written */
    int err = 0;
    if (timeline) timeline[0] = now_ns();
    #pragma omp parallel num_threads(nthreads)
    {
        int sender = omp_get_thread_num() == 0;
        int64_t launched = 0, freed = 0;   /* the sender's own counters */
        for (;;) {
            int64_t k;
            if (sender) {
                int progress = 0;
                if (freed < n_chunks && (freed < ring_len || freed - ring_len < launched)) {
                    int q = query(ring_events[(ring_start + freed) % ring_len]);
                    if (q == 0) {
                        if (timeline) timeline[1 + 3 * freed] = now_ns();
                        __atomic_store_n(&writable, ++freed, __ATOMIC_RELEASE);
                        progress = 1;
                    } else if (q != NOT_READY) {
                        __atomic_store_n(&err, q, __ATOMIC_RELEASE);
                    }
                }
                if (launched < n_chunks) {
                    int64_t rows = bounds[launched + 1] - bounds[launched];
                    if (__atomic_load_n(&done[launched], __ATOMIC_ACQUIRE) == rows) {
                        int b = (int)((ring_start + launched) % ring_len);
                        if (timeline) timeline[2 + 3 * launched] = now_ns();
                        int e = memcpy_async(dst + bounds[launched] * row_bytes, ring[b], (size_t)(rows * row_bytes),
                                             1, stream);
                        if (!e) e = record(ring_events[b], stream);
                        if (e) __atomic_store_n(&err, e, __ATOMIC_RELEASE);
                        if (timeline) timeline[3 + 3 * launched] = now_ns();
                        launched++;
                        progress = 1;
                    }
                }
                if (launched == n_chunks || __atomic_load_n(&err, __ATOMIC_ACQUIRE)) break;
                if (progress) continue;
                /* Idle: gather one piece, if the next one is in a writable chunk (CAS: take it only then). */
                k = __atomic_load_n(&next_piece, __ATOMIC_RELAXED);
                if (!(k < n_pieces && piece_chunk[k] < __atomic_load_n(&writable, __ATOMIC_ACQUIRE) &&
                      __atomic_compare_exchange_n(&next_piece, &k, k + 1, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))) {
                    cpu_relax();
                    continue;
                }
            } else {
                k = __atomic_fetch_add(&next_piece, 1, __ATOMIC_RELAXED);
                if (k >= n_pieces) break;
                while (__atomic_load_n(&writable, __ATOMIC_ACQUIRE) <= piece_chunk[k] &&
                       !__atomic_load_n(&err, __ATOMIC_ACQUIRE))
                    cpu_relax();
                if (__atomic_load_n(&err, __ATOMIC_ACQUIRE)) break;
            }
            int64_t c = piece_chunk[k], s = piece_start[k], e = s + PIECE;
            if (e > bounds[c + 1]) e = bounds[c + 1];
            gather_piece(src, row_bytes, ids, s, e, ring[(ring_start + c) % ring_len] + (s - bounds[c]) * row_bytes);
            __atomic_fetch_add(&done[c], e - s, __ATOMIC_RELEASE);
        }
    }
    free(done);
    return err;
}

/* Rows read straight from a file opened with O_DIRECT (no page cache): row ids[i] of
   `row_bytes` at file offset `offset` + ids[i] * row_bytes -> dst row i. Each thread reads
   the aligned 4 KiB blocks that hold its row (two when the row straddles a block edge) into
   its own aligned buffer, so `nthreads` reads are in flight. Returns 0, or -errno of the first
   failed read (-EIO for a row past the end of the file). */
#include <unistd.h>
#include <errno.h>
int64_t condmem_pread_rows(int fd, int64_t offset, int64_t row_bytes, const int64_t *ids, int64_t n,
                           uint8_t *dst, int nthreads) {
    const int64_t B = 4096;
    int64_t err = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        uint8_t *buf = NULL;
        int64_t cap = ((row_bytes + 2 * B - 1) / B) * B;
        if (posix_memalign((void **)&buf, (size_t)B, (size_t)cap)) {
            buf = NULL;
            __atomic_store_n(&err, -ENOMEM, __ATOMIC_RELAXED);
        }
        #pragma omp for schedule(dynamic, 8)
        for (int64_t i = 0; i < n; i++) {
            if (!buf || __atomic_load_n(&err, __ATOMIC_RELAXED)) continue;
            int64_t pos = offset + ids[i] * row_bytes;
            int64_t start = pos & ~(B - 1);
            int64_t len = ((pos + row_bytes - start + B - 1) / B) * B;
            int64_t got = 0;
            while (got < len) {
                ssize_t r = pread(fd, buf + got, (size_t)(len - got), (off_t)(start + got));
                if (r < 0) {
                    if (errno == EINTR) continue;
                    __atomic_store_n(&err, (int64_t)-errno, __ATOMIC_RELAXED);
                    break;
                }
                if (r == 0) break;                     /* end of file: the last block is short */
                got += r;
            }
            if (got < pos - start + row_bytes) {
                int64_t zero = 0;
                __atomic_compare_exchange_n(&err, &zero, (int64_t)-EIO, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
                continue;
            }
            memcpy(dst + i * row_bytes, buf + (pos - start), (size_t)row_bytes);
        }
        free(buf);
    }
    return err;
}

/* Host stand-ins for the runtime calls (tests). `stream` points to int64 counters: stream[0]
   counts sends and the send numbered stream[1] (when > 0) fails with code 7; event[0] counts
   records. `memcpy` copies at once; `done_query` says done at once and carries out nothing
   (a negative control: the wait of a send that does not wait). */
int condmem_test_memcpy(void *dst, const void *src, size_t bytes, int kind, void *stream) {
    int64_t *counters = (int64_t *)stream;
    counters[0]++;
    if (counters[1] > 0 && counters[0] == counters[1]) return 7;
    memcpy(dst, src, bytes);
    return kind == 1 ? 0 : 9;
}
int condmem_test_record(void *event, void *stream) { (void)stream; ((int64_t *)event)[0]++; return 0; }
int condmem_test_done_query(void *event) { ((int64_t *)event)[1]++; return 0; }
/* Stand-ins that model an asynchronous copy (tests of the ring's reuse): the copy queued by
   deferred_memcpy is attached to the event the next deferred_record records, and is carried
   out only when `query` first reports that event done, after event[6] "not ready" answers. A
   send that rewrote a ring buffer before its query said done would deliver the wrong rows.
   stream: int64 [sends, fail_at, dst, src, bytes]; event: int64 [records, queries,
   not-ready left, dst, src, bytes, delay]. */
int condmem_test_deferred_memcpy(void *dst, const void *src, size_t bytes, int kind, void *stream) {
    int64_t *s = (int64_t *)stream;
    s[0]++;
    if (s[1] > 0 && s[0] == s[1]) return 7;
    s[2] = (int64_t)(intptr_t)dst; s[3] = (int64_t)(intptr_t)src; s[4] = (int64_t)bytes;
    return kind == 1 ? 0 : 9;
}
int condmem_test_deferred_record(void *event, void *stream) {
    int64_t *e = (int64_t *)event, *s = (int64_t *)stream;
    e[0]++;
    e[3] = s[2]; e[4] = s[3]; e[5] = s[4]; e[2] = e[6];
    s[4] = 0;
    return 0;
}
int condmem_test_query(void *event) {
    int64_t *e = (int64_t *)event;
    e[1]++;
    if (e[2] > 0) { e[2]--; return NOT_READY; }
    if (e[5] > 0) { memcpy((void *)(intptr_t)e[3], (const void *)(intptr_t)e[4], (size_t)e[5]); e[5] = 0; }
    return 0;
}
""".replace("PF", str(PREFETCH_DISTANCE))

_lock = threading.Lock()
_lib = None
_tried = False


def _cache_dir() -> Path:
    root = os.environ.get("CONDMEM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "condmem")
    return Path(root) / "native"


def _load():
    """The loaded library, or None (compiled on the first call; later calls take no lock:
    every native gather and send calls this)."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            _lib = _compile_and_load()
            _tried = True      # set after _lib: a caller that sees it sees the library too
    return _lib


def _compile_and_load():
    """Compile the C source (once per machine: cached by its hash) and load it; None on failure."""
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
    lib.condmem_gather_stream.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,                     # src, row_bytes, ids
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,        # ring, events, ring_len, start
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,   # bounds, n_chunks, dst, stream
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,      # memcpy, record, query, threads
        ctypes.c_void_p]                                                      # timeline (or None)
    lib.condmem_gather_stream.restype = ctypes.c_int
    lib.condmem_pread_rows.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                       ctypes.c_void_p, ctypes.c_int]
    lib.condmem_pread_rows.restype = ctypes.c_int64
    return lib


def native_pread_rows(fd: int, offset: int, row_bytes: int, ids: torch.Tensor, out: torch.Tensor,
                      threads: int) -> int | None:
    """`condmem_pread_rows` (see the C source): 0, -errno, or None without the native library."""
    lib = _load()
    if lib is None:
        return None
    return int(lib.condmem_pread_rows(fd, offset, row_bytes, ids.data_ptr(), ids.numel(), out.data_ptr(), threads))


def runtime_stand_ins() -> dict[str, int]:
    """Addresses of the host stand-ins for the CUDA runtime calls of `condmem_gather_stream`
    (``memcpy``, ``record``, ``done_query``, ``deferred_memcpy``, ``deferred_record``, ``query``:
    see the C source), for tests that run the staged send without a GPU."""
    lib = _load()
    if lib is None:
        raise RuntimeError("the native gather is unavailable (no C compiler?)")
    return {name: ctypes.cast(getattr(lib, f"condmem_test_{name}"), ctypes.c_void_p).value
            for name in ("memcpy", "record", "done_query", "deferred_memcpy", "deferred_record", "query")}


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
