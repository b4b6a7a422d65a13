/* Host stand-ins for the CUDA runtime calls of condmem_gather_stream (src/condmem/native/gather.c),
   for tests that run the native staged send without a GPU. Built by tests/native_stand_ins.py;
   never part of the installed library. */

#include <stdint.h>
#include <string.h>

#define NOT_READY 600 /* cudaErrorNotReady */

/* `stream` points to int64 counters: stream[0] counts sends and the send numbered stream[1]
   (when > 0) fails with code 7; event[0] counts records. `memcpy` copies at once;
   `done_query` says done at once and carries out nothing (a negative control: the wait of a
   send that does not wait). */
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
