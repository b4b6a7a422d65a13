/* condmem's native CPU row gather, staged send and O_DIRECT row reads (OpenMP).

   Random reads of 264 B rows from a table of tens of GiB are bound by memory latency: a plain
   copy loop (torch's index_select) stalls on every row, since the next address is unknown to
   the hardware prefetcher. Here each thread prefetches the row PREFETCH_DISTANCE iterations
   ahead while it copies the current one, so many misses are in flight at once.

   Built as the extension `condmem.native._gather` (setup.py) and called through ctypes
   (src/condmem/native/__init__.py), which releases the GIL for the call. No Python or CUDA
   headers: the CUDA runtime calls of the staged send are passed in as function pointers.
   The copies go through libc's memcpy, which picks its vector width at run time, so the
   portable baseline build (no -march) loses nothing measurable to a -march=native one. */

#include <errno.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() do { } while (0)
#endif

/* Rows prefetched ahead: the fastest distance of the CPU gather probe's sweep
   (benchmarks/probes/cpu_gather_probe.py; docs/benchmarks.md). */
#ifndef PREFETCH_DISTANCE
#define PREFETCH_DISTANCE 12
#endif

/* sha256 prefix of this file, set by the build (setup.py, or the loader's development build):
   the loader refuses a library built from another version of this source. */
#ifndef CONDMEM_SOURCE_DIGEST
#define CONDMEM_SOURCE_DIGEST "unknown"
#endif
const char *condmem_source_digest(void) { return CONDMEM_SOURCE_DIGEST; }

/* Row i of dst <- row ids[i] of src. The row PREFETCH_DISTANCE ahead is prefetched into every cache level
   (hint T0: faster than NTA, T1 or T2 in the CPU gather probe; docs/benchmarks.md). */
static inline void copy_row(const uint8_t *src, int64_t row_bytes, const int64_t *ids, int64_t i, int64_t n,
                            uint8_t *dst_row) {
    if (i + PREFETCH_DISTANCE < n) {
        const uint8_t *ahead = src + ids[i + PREFETCH_DISTANCE] * row_bytes;
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
   small ones (a barrier per chunk made sends 1.4x slower: docs/lookup-engine.md).

   `timeline` (NULL: none): 1 + 3 * n_chunks int64, nanoseconds on CLOCK_MONOTONIC: the
   start, then per chunk when its buffer became writable, when its last piece was in (as the
   sender saw it), when its send was queued.
   Returns 0, or the first nonzero code a runtime call returned (nothing after it is sent). */
static inline void gather_piece(const uint8_t *src, int64_t row_bytes, const int64_t *ids, int64_t s, int64_t e,
                                uint8_t *dst) {
    for (int64_t i = s; i < e && i < s + PREFETCH_DISTANCE; i++) {       /* the first rows: nobody prefetched them */
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

uint32_t condmem_crc32c(uint32_t crc, const uint8_t *p, int64_t n);   /* checksum.c */

/* Rows read from a file with pread, by `nthreads` threads at once (the disk's queue depth):
   row ids[i] of `row_bytes` at file offset `offset` + ids[i] * row_bytes -> dst row i. Each
   thread reads whole aligned blocks into its own aligned buffer, so the descriptor may be
   opened with O_DIRECT (no page cache) or without.

   With `sums` NULL a row costs the 4 KiB pages that hold it. Otherwise every `block`-byte block
   (a multiple of 4096, on the file's absolute grid, clipped to the tensor's bytes [span_lo,
   span_hi)) that holds part of a row is read whole and its CRC32C compared with
   sums[block index - span_lo / block]: a row is copied out only when all its blocks match.

   Returns 0; 1 when a block did not match (bad[0] = i, bad[1] = the block's index in `sums`);
   or -errno of the first failed read (-EIO for a read that ends before the bytes it needs: a
   row past the end of the file, e.g. one truncated since it was opened). */
int64_t condmem_pread_rows(int fd, int64_t offset, int64_t row_bytes, const int64_t *ids, int64_t n,
                           uint8_t *dst, int nthreads, const uint32_t *sums, int64_t span_lo, int64_t span_hi,
                           int64_t block, int64_t *bad) {
    const int64_t B = sums ? block : 4096;
    int64_t err = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        uint8_t *buf = NULL;
        int64_t cap = (row_bytes / B + 2) * B;
        if (posix_memalign((void **)&buf, 4096, (size_t)cap)) {
            buf = NULL;
            __atomic_store_n(&err, -ENOMEM, __ATOMIC_RELAXED);
        }
        #pragma omp for schedule(dynamic, 8)
        for (int64_t i = 0; i < n; i++) {
            if (!buf || __atomic_load_n(&err, __ATOMIC_RELAXED)) continue;
            int64_t pos = offset + ids[i] * row_bytes;
            int64_t start = pos / B * B;
            int64_t len = ((pos + row_bytes - start + B - 1) / B) * B;
            int64_t need = pos - start + row_bytes;
            if (sums) {   /* the whole last block, as far as the tensor goes */
                int64_t end = start + len < span_hi ? start + len : span_hi;
                if (end - start > need) need = end - start;
            }
            int64_t got = 0;
            while (got < len) {
                ssize_t r = pread(fd, buf + got, (size_t)(len - got), (off_t)(start + got));
                if (r < 0) {
                    if (errno == EINTR) continue;
                    int64_t zero = 0;
                    __atomic_compare_exchange_n(&err, &zero, (int64_t)-errno, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
                    break;
                }
                if (r == 0) break;                     /* end of file: the last block is short */
                got += r;
            }
            if (got < need) {
                int64_t zero = 0;
                __atomic_compare_exchange_n(&err, &zero, (int64_t)-EIO, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
                continue;
            }
            if (sums) {
                int64_t mismatch = -1;
                for (int64_t b = start; b < start + len && b < span_hi; b += B) {
                    int64_t lo = b < span_lo ? span_lo : b;
                    int64_t hi = b + B < span_hi ? b + B : span_hi;
                    if (condmem_crc32c(0, buf + (lo - start), hi - lo) != sums[b / B - span_lo / B]) {
                        mismatch = b / B - span_lo / B;
                        break;
                    }
                }
                if (mismatch >= 0) {
                    int64_t zero = 0;
                    if (__atomic_compare_exchange_n(&err, &zero, 1, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
                        bad[0] = i;
                        bad[1] = mismatch;
                    }
                    continue;
                }
            }
            memcpy(dst + i * row_bytes, buf + (pos - start), (size_t)row_bytes);
        }
        free(buf);
    }
    return err;
}
