/* condmem's decode row server: host threads that stage each decode step's Engram rows.

   A GPU that reads a large host table in place (zero-copy) is bound by address translation,
   and its misses slow the kernels running beside the fetch (docs/serving.md). Here the CPU
   does the random reads instead: the decode graph copies the step's row ids into pinned host
   memory and raises `request`; the server's threads gather those rows from the host tables
   into small pinned staging buffers and raise `done[l]` per layer, in layer order; the graph
   waits for `done[l]` (a stream wait on host memory, no SM held), copies the staged rows to
   the device by DMA and lowers `done[l]` again. Both flags take the values 0 and 1 only, so
   the graph, which replays the same writes every step, needs no step counter:

       GPU: ids -> host, request = 1 ........ wait done[l] == 1, copy rows, done[l] = 0
       CPU:          see request, request = 0, gather layer l, done[l] = 1

   The next request is written after the GPU lowered every done flag of this one (stream
   order), and the server raises done only after it took the request, so no step's flags mix
   with another's.

   The team spins while steps come (a decode step arrives every few ms, and a sleeping thread
   takes tens of microseconds to wake), naps 20 us at a time after `spin_ns` without a
   request, and 1 ms at a time after a second (an idle server costs next to no CPU; the first
   step after such a pause waits up to 1 ms longer). Rows are handed out in pieces from one counter, layer by layer, so layer 0's
   rows are staged first and its flag raised before later layers' rows are done.

   Ids outside a layer's table are not read: the row is zeroed and counted in `bad_ids`,
   which the Python side checks and raises on. */

#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define relax() _mm_pause()
#elif defined(__aarch64__)
#define relax() __asm__ __volatile__("yield")
#else
#define relax() do { } while (0)
#endif

#define MAX_LAYERS 16
#define MAX_THREADS 64
#define PIECE_ROWS 64
#define AHEAD 12          /* rows prefetched ahead, as gather.c's PREFETCH_DISTANCE */
#define LONG_IDLE_NS 1000000000LL

typedef struct {
    /* Set by the caller before `condmem_row_server_start`, read-only afterwards. */
    int32_t *request;             /* host-mapped; the GPU writes 1 */
    int32_t *done;                /* host-mapped [n_layers]; the server writes 1, the GPU 0 */
    const int64_t *ids;           /* host-mapped [n_layers][n_ids], written by the GPU's copy */
    int64_t n_ids;                /* ids (= rows) per layer a step */
    int32_t n_layers;
    int32_t n_threads;            /* the team, the leader included */
    const uint8_t *src[MAX_LAYERS];     /* table rows [num_rows[l]][row_bytes[l]] */
    uint8_t *dst[MAX_LAYERS];           /* staging rows [n_ids][row_bytes[l]] */
    int64_t row_bytes[MAX_LAYERS];
    int64_t num_rows[MAX_LAYERS];
    int64_t spin_ns;              /* keep spinning this long after a request */
    /* Written by the server, read by the caller. */
    int64_t steps;                /* requests served */
    int64_t bad_ids;              /* ids outside their table (rows zeroed) */
    int64_t busy_ns;              /* request seen -> last layer's flag raised, summed */
    int64_t max_ns;
    /* Shared by the team. */
    int32_t stop;
    int64_t generation;           /* bumped by the leader for each request */
    int64_t next_piece;           /* pieces handed out of this request */
    int64_t pieces_done[MAX_LAYERS];
    int64_t pieces_per_layer;
    int64_t started;              /* threads running */
    pthread_t threads[MAX_THREADS];
} condmem_row_server;

static int64_t clock_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline int64_t load64(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

/* Copy piece `piece` (layer-major) into its staging rows. */
static void serve_piece(condmem_row_server *s, int64_t piece) {
    const int64_t layer = piece / s->pieces_per_layer;
    const int64_t first = (piece % s->pieces_per_layer) * PIECE_ROWS;
    const int64_t last = first + PIECE_ROWS < s->n_ids ? first + PIECE_ROWS : s->n_ids;
    const int64_t rb = s->row_bytes[layer], rows = s->num_rows[layer];
    const uint8_t *src = s->src[layer];
    const int64_t *ids = s->ids + layer * s->n_ids;
    uint8_t *dst = s->dst[layer];
    int64_t bad = 0;
    for (int64_t i = first; i < last && i < first + AHEAD; i++) {
        int64_t id = ids[i];
        if (id >= 0 && id < rows)
            for (int64_t off = 0; off < rb; off += 64) __builtin_prefetch(src + id * rb + off, 0, 3);
    }
    for (int64_t i = first; i < last; i++) {
        if (i + AHEAD < last) {
            int64_t ahead = ids[i + AHEAD];
            if (ahead >= 0 && ahead < rows)
                for (int64_t off = 0; off < rb; off += 64) __builtin_prefetch(src + ahead * rb + off, 0, 3);
        }
        int64_t id = ids[i];
        if (id >= 0 && id < rows) {
            memcpy(dst + i * rb, src + id * rb, (size_t)rb);
        } else {
            memset(dst + i * rb, 0, (size_t)rb);
            bad++;
        }
    }
    if (bad) __atomic_fetch_add(&s->bad_ids, bad, __ATOMIC_RELAXED);
    __atomic_fetch_add(&s->pieces_done[layer], 1, __ATOMIC_RELEASE);
}

/* Take pieces until none is left; the leader also raises each layer's flag once its pieces are in. */
static void work(condmem_row_server *s, int leader) {
    const int64_t total = s->pieces_per_layer * s->n_layers;
    int32_t published = 0;
    for (;;) {
        int64_t piece = __atomic_fetch_add(&s->next_piece, 1, __ATOMIC_ACQ_REL);
        if (piece < total) serve_piece(s, piece);
        if (!leader) {
            if (piece >= total) return;
            continue;
        }
        while (published < s->n_layers && load64(&s->pieces_done[published]) == s->pieces_per_layer) {
            __atomic_store_n(&s->done[published], 1, __ATOMIC_RELEASE);
            published++;
        }
        if (piece >= total) break;
    }
    while (published < s->n_layers) {           /* pieces other threads still copy */
        if (load64(&s->pieces_done[published]) == s->pieces_per_layer) {
            __atomic_store_n(&s->done[published], 1, __ATOMIC_RELEASE);
            published++;
        } else {
            relax();
        }
    }
}

/* One turn of waiting for work that has not come since `since`: spin (the clock read every
   1024 turns), then once `spin_ns` passed nap on every turn, longer after LONG_IDLE_NS. */
static void idle_turn(const condmem_row_server *s, int64_t since, unsigned *spins) {
    if (*spins < 1024) {
        (*spins)++;
        relax();
        return;
    }
    int64_t idle = clock_ns() - since;
    if (idle <= s->spin_ns) {
        *spins = 0;
        relax();
    } else {
        usleep(idle > LONG_IDLE_NS ? 1000 : 20);
    }
}

/* Wait for `*flag != seen` (or stop). */
static int wait_change_i64(condmem_row_server *s, const int64_t *flag, int64_t seen, int64_t since) {
    unsigned spins = 0;
    while (load64(flag) == seen) {
        if (__atomic_load_n(&s->stop, __ATOMIC_ACQUIRE)) return 0;
        idle_turn(s, since, &spins);
    }
    return 1;
}

static void *helper_main(void *arg) {
    condmem_row_server *s = arg;
    int64_t seen = load64(&s->generation);
    int64_t since = clock_ns();
    while (wait_change_i64(s, &s->generation, seen, since)) {
        seen = load64(&s->generation);
        work(s, 0);
        since = clock_ns();
    }
    return NULL;
}

static void *leader_main(void *arg) {
    condmem_row_server *s = arg;
    int64_t since = clock_ns();
    unsigned spins = 0;
    while (!__atomic_load_n(&s->stop, __ATOMIC_ACQUIRE)) {
        if (__atomic_load_n(s->request, __ATOMIC_ACQUIRE) != 1) {
            idle_turn(s, since, &spins);
            continue;
        }
        int64_t t0 = clock_ns();
        __atomic_store_n(s->request, 0, __ATOMIC_RELEASE);
        for (int32_t l = 0; l < s->n_layers; l++) __atomic_store_n(&s->pieces_done[l], 0, __ATOMIC_RELAXED);
        __atomic_store_n(&s->next_piece, 0, __ATOMIC_RELEASE);
        __atomic_fetch_add(&s->generation, 1, __ATOMIC_ACQ_REL);
        work(s, 1);
        int64_t took = clock_ns() - t0;
        s->busy_ns += took;
        if (took > s->max_ns) s->max_ns = took;
        __atomic_fetch_add(&s->steps, 1, __ATOMIC_RELEASE);
        since = clock_ns();
        spins = 0;
    }
    return NULL;
}

/* Start the team (n_threads: the leader and n_threads - 1 helpers). Returns 0, or -1 for bad
   arguments, or the error of pthread_create (threads already started are stopped). */
int condmem_row_server_start(condmem_row_server *s) {
    if (s->n_layers < 1 || s->n_layers > MAX_LAYERS || s->n_threads < 1 || s->n_threads > MAX_THREADS ||
        s->n_ids < 0 || !s->request || !s->done || !s->ids)
        return -1;
    s->pieces_per_layer = (s->n_ids + PIECE_ROWS - 1) / PIECE_ROWS;
    s->stop = 0;
    s->generation = 0;
    s->next_piece = s->pieces_per_layer * s->n_layers;   /* nothing to take before a request */
    s->started = 0;
    for (int32_t t = 0; t < s->n_threads; t++) {
        int rc = pthread_create(&s->threads[t], NULL, t == 0 ? leader_main : helper_main, s);
        if (rc) {
            __atomic_store_n(&s->stop, 1, __ATOMIC_RELEASE);
            for (int32_t j = 0; j < t; j++) pthread_join(s->threads[j], NULL);
            return rc;
        }
        s->started = t + 1;
    }
    return 0;
}

/* Stop and join the team (a request in progress is finished first). */
void condmem_row_server_stop(condmem_row_server *s) {
    __atomic_store_n(&s->stop, 1, __ATOMIC_RELEASE);
    for (int64_t t = 0; t < s->started; t++) pthread_join(s->threads[t], NULL);
    s->started = 0;
}

/* sizeof the struct: the Python side checks its mirror of it against this. */
int64_t condmem_row_server_size(void) { return (int64_t)sizeof(condmem_row_server); }
