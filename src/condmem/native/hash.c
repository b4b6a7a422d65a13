/* condmem's native n-gram hash of one decode step on the CPU.

   The same numbers as `condmem.ops.hash.reference.hash_decode_reference` (the tests compare
   them with torch.equal): each row's new token is mapped to its compressed id, mixed with the
   sequence's N-1 previous compressed ids, reduced modulo each column's prime, offset into the
   layer's table, and the sequence's history shifted by one. A decode step hashes a few hundred
   tokens, so one thread in a plain loop beats the dozens of small torch ops the reference
   launches (docs/serving.md). Built into the same library as gather.c. */

#include <stddef.h>
#include <stdint.h>

/* history  int64 [n_slots, n_back] (n_back = N-1), updated in place for live rows
   slots    int64 [batch]; outside [0, n_slots) marks a padding row
   ids      int64 [batch] token ids; through `lookup` (int64 [vocab], may be NULL) to compressed
            ids, an id outside [0, vocab) reading the pad
   valid    uint8 [batch] or NULL: 0 marks a padding row
   blocked  uint8 [batch] or NULL: 1 hides the new token (and all before it) from later look-backs
   multipliers int64 [n_layers, N]; primes, offsets int64 [n_layers, n_cols] (offsets may be NULL),
   n_cols = n_back * n_heads in (order, head) order
   out      int64 [batch, n_layers, n_cols]: padding rows hold bucket 0 (+ offset) of every column.
   Live rows must name distinct slots. Products and XORs run on uint64 (wrapping, as torch's
   int64 arithmetic does) and the remainder on their two's-complement value. */
void condmem_hash_decode(int64_t *history, int64_t n_slots, int64_t n_back, const int64_t *slots,
                         const int64_t *ids, const int64_t *lookup, int64_t vocab, const uint8_t *valid,
                         const uint8_t *blocked, int64_t batch, const int64_t *multipliers, const int64_t *primes,
                         const int64_t *offsets, int64_t n_layers, int64_t n_heads, int64_t pad_id, int64_t *out) {
    const int64_t n_cols = n_back * n_heads;
    uint64_t window[64];   /* distance 0..N-1; the layout limits N far below this */
    for (int64_t b = 0; b < batch; b++) {
        const int64_t slot = slots[b];
        const int live = slot >= 0 && slot < n_slots && (valid == NULL || valid[b]);
        int64_t c = pad_id;
        if (live) {
            c = ids[b];
            if (lookup != NULL) c = (c >= 0 && c < vocab) ? lookup[c] : pad_id;
        }
        int64_t *hist = live ? history + slot * n_back : NULL;
        window[0] = (uint64_t)c;
        for (int64_t k = 1; k <= n_back; k++) window[k] = live ? (uint64_t)hist[k - 1] : (uint64_t)pad_id;
        int64_t *row = out + b * n_layers * n_cols;
        for (int64_t l = 0; l < n_layers; l++) {
            const int64_t *m = multipliers + l * (n_back + 1);
            const int64_t *p = primes + l * n_cols;
            const int64_t *o = offsets != NULL ? offsets + l * n_cols : NULL;
            uint64_t mix = window[0] * (uint64_t)m[0];
            for (int64_t k = 1; k <= n_back; k++) {
                mix ^= window[k] * (uint64_t)m[k];
                for (int64_t h = 0; h < n_heads; h++) {
                    const int64_t col = (k - 1) * n_heads + h;
                    /* Python-style remainder of the two's-complement mix, as torch.remainder: the
                       same bucket for the (never negative) mixes of in-range ids, and for the
                       rest too (a token id outside the vocabulary with no lookup table). */
                    int64_t bucket = 0;
                    if (live) {
                        bucket = (int64_t)mix % p[col];
                        if (bucket < 0) bucket += p[col];
                    }
                    row[l * n_cols + col] = o != NULL ? bucket + o[col] : bucket;
                }
            }
        }
        if (live) {
            const int hide = blocked != NULL && blocked[b];
            for (int64_t k = n_back - 1; k >= 1; k--) hist[k] = hide ? pad_id : hist[k - 1];
            if (n_back > 0) hist[0] = hide ? pad_id : c;
        }
    }
}
