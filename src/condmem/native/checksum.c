/* CRC32C (Castagnoli, as iSCSI, ext4 and google-crc32c) of table-file blocks.

   Table files record one CRC32C per block of every tensor (condmem/tables/integrity.py), and
   every byte a tier serves is checked against it: the host tier checks the whole table as it
   loads it (`condmem_crc32c_blocks`), the disk tier each block it reads (gather.c,
   `condmem_pread_rows`). On x86-64 the SSE4.2 crc32 instruction runs (about 8 GB/s a core),
   chosen at run time so the portable baseline build keeps it; elsewhere a slicing-by-8 table
   (about 2 GB/s). Both give the standard CRC32C: init and final xor 0xFFFFFFFF, so
   crc32c("123456789") = 0xE3069283, and `condmem_crc32c(condmem_crc32c(0, a), b)` is the CRC of a||b. */

#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

static uint32_t table[8][256];

typedef uint32_t (*crc_fn)(uint32_t, const uint8_t *, int64_t);
static crc_fn impl;
static uint32_t crc_soft(uint32_t crc, const uint8_t *p, int64_t n);
static crc_fn pick(void);

/* Run when the library is loaded, before any caller's thread can use the table. */
__attribute__((constructor)) static void init_table(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xFF];
    impl = pick();
}

static uint32_t crc_soft(uint32_t crc, const uint8_t *p, int64_t n) {
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc;   /* little-endian: the low 4 bytes take the running CRC */
        crc = table[7][w & 0xFF] ^ table[6][(w >> 8) & 0xFF] ^ table[5][(w >> 16) & 0xFF] ^
              table[4][(w >> 24) & 0xFF] ^ table[3][(w >> 32) & 0xFF] ^ table[2][(w >> 40) & 0xFF] ^
              table[1][(w >> 48) & 0xFF] ^ table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n-- > 0) crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xFF];
    return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc_hard(uint32_t crc, const uint8_t *p, int64_t n) {
    uint64_t c = crc;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (n-- > 0) c32 = _mm_crc32_u8(c32, *p++);
    return c32;
}
#endif

static crc_fn pick(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) return crc_hard;
#endif
    return crc_soft;
}

uint32_t condmem_crc32c(uint32_t crc, const uint8_t *p, int64_t n) {
    return ~impl(~crc, p, n);
}

/* 1 when the SSE4.2 instruction computes the CRCs, 0 for the table. */
int condmem_crc32c_hardware(void) { return impl != crc_soft; }

/* CRC32C of consecutive blocks of `p` [n bytes]: the first block is `first` bytes (1..block),
   the others `block`, the last one whatever is left. With `expected` NULL the CRCs go to `out`
   and the result is -1; otherwise each is compared with expected[k] and the result is the
   first k that differs (-1: all equal). `nthreads` OpenMP threads split the blocks. */
int64_t condmem_crc32c_blocks(const uint8_t *p, int64_t n, int64_t first, int64_t block, uint32_t *out,
                              const uint32_t *expected, int nthreads) {
    if (n <= 0) return -1;
    if (first <= 0 || first > block) first = block;
    int64_t count = n <= first ? 1 : 1 + (n - first + block - 1) / block;
    int64_t bad = INT64_MAX;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && count > 64)
    for (int64_t k = 0; k < count; k++) {
        int64_t lo = k == 0 ? 0 : first + (k - 1) * block;
        int64_t hi = k == 0 ? first : lo + block;
        if (hi > n) hi = n;
        uint32_t c = condmem_crc32c(0, p + lo, hi - lo);
        if (expected == NULL) {
            out[k] = c;
        } else if (c != expected[k]) {
            int64_t seen = __atomic_load_n(&bad, __ATOMIC_RELAXED);
            while (k < seen && !__atomic_compare_exchange_n(&bad, &seen, k, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
        }
    }
    return bad == INT64_MAX ? -1 : bad;
}
