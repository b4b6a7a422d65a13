"""Held-out text a skeptic can trust: near-duplicate removal and seen/unseen n-gram buckets.

* `near_duplicate_fractions`: for each validation document, the fraction of its token
  n-grams (default 13 tokens) that occur anywhere in the training stream. A document
  above a threshold (default 0.5) is a near-copy of training text (a codec table beside
  thirty others, a vendored module): an n-gram memory would score on it by recall, so
  the demo drops it from validation and reports what it dropped.
* `seen_in_training`: for each validation target, whether its trailing n-gram (the two
  tokens before it and itself, for n = 3) occurs in the training stream, so a loss can
  be split into what the training data showed and what it did not.

Membership is decided without sorting the (large) training stream: the (small) set of
validation keys is sorted once and the training keys are computed and looked up in it a
chunk at a time (`stream_ngram_keys`), so the stream may be a memory map or a file's pieces.
N-grams of more than 3 tokens are keyed by a 64-bit polynomial hash (a false match has
probability ~ n_keys / 2^64); 3-grams by their exact ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Sequence

import numpy as np

DEDUP_NGRAM = 13
"""Tokens per n-gram of the near-duplicate test (long enough that code idioms rarely match)."""

DEDUP_THRESHOLD = 0.5
"""A validation document with more than this fraction of its n-grams in training is dropped."""

_HASH_MULT = np.uint64(0x9E3779B97F4A7C15)
_CHUNK = 1 << 22


def ngram_keys(tokens: np.ndarray, n: int, vocab_size: int | None = None) -> np.ndarray:
    """One uint64 key per n-gram start (``len(tokens) - n + 1`` keys; none if shorter than n).

    With ``n <= 3`` and ``vocab_size ** n < 2**63`` the key is exact
    (``sum tokens[i+j] * vocab**(n-1-j)``); otherwise it is a polynomial hash mod 2^64.
    """
    if n < 1:
        raise ValueError(f"n-gram size must be >= 1, got {n}")
    t = np.asarray(tokens).astype(np.uint64, copy=False)
    m = len(t) - n + 1
    if m <= 0:
        return np.zeros(0, dtype=np.uint64)
    exact = vocab_size is not None and n <= 3 and vocab_size**n < 2**63
    base = np.uint64(vocab_size) if exact else _HASH_MULT
    key = t[:m].copy()
    with np.errstate(over="ignore"):
        for j in range(1, n):
            key *= base
            key += t[j : j + m] if exact else (t[j : j + m] + np.uint64(j)) * np.uint64(0xBF58476D1CE4E5B9)
    return key


def stream_ngram_keys(
    tokens: np.ndarray | Iterable[np.ndarray], n: int, vocab_size: int | None = None
) -> Iterator[np.ndarray]:
    """`ngram_keys` of a token stream, a chunk of keys at a time: the stream is one array (a
    memory map is read a slice at a time) or its consecutive pieces in order (a file read in
    chunks). Concatenated, the chunks equal ``ngram_keys(whole stream, n, vocab_size)``."""
    pieces = (
        (tokens[i : i + _CHUNK] for i in range(0, len(tokens), _CHUNK)) if isinstance(tokens, np.ndarray) else tokens
    )
    carry = np.zeros(0, dtype=np.int64)
    for piece in pieces:
        joined = np.concatenate([carry, np.asarray(piece, dtype=np.int64)])
        yield ngram_keys(joined, n, vocab_size)
        carry = joined[max(0, len(joined) - (n - 1)) :] if n > 1 else joined[:0]


def member_of(queries: np.ndarray, stream_keys: np.ndarray | Iterable[np.ndarray]) -> np.ndarray:
    """bool per query: does it occur in `stream_keys` (uint64; one array or chunks of it)?
    Cost O(len(stream) log len(queries))."""
    uniq, inverse = np.unique(queries, return_inverse=True)
    found = np.zeros(len(uniq), dtype=bool)
    if len(uniq) == 0:
        return found[inverse]
    chunks = (
        (stream_keys[i : i + _CHUNK] for i in range(0, len(stream_keys), _CHUNK))
        if isinstance(stream_keys, np.ndarray)
        else stream_keys
    )
    for chunk in chunks:
        at = np.searchsorted(uniq, chunk)
        np.minimum(at, len(uniq) - 1, out=at)
        found[at[uniq[at] == chunk]] = True
    return found[inverse.reshape(-1)]


def near_duplicate_fractions(
    train_tokens: np.ndarray | Iterable[np.ndarray], docs: Sequence[np.ndarray], n: int = DEDUP_NGRAM
) -> np.ndarray:
    """float per document: the fraction of its n-grams found in `train_tokens` (0 if it has none).
    `train_tokens`: the stream, or its consecutive pieces (`stream_ngram_keys`); memory is the
    documents' keys plus one chunk of the stream's."""
    keys = [ngram_keys(d, n) for d in docs]
    sizes = np.array([len(k) for k in keys])
    if sizes.sum() == 0:
        return np.zeros(len(docs))
    hit = member_of(np.concatenate(keys), stream_ngram_keys(train_tokens, n))
    cum = np.concatenate([[0], np.cumsum(hit, dtype=np.int64)])
    ends = np.cumsum(sizes)
    per_doc = cum[ends] - cum[ends - sizes]
    return np.divide(per_doc, sizes, out=np.zeros(len(docs)), where=sizes > 0)


def seen_in_training(
    train_tokens: np.ndarray, val_tokens: np.ndarray, vocab_size: int, n: int = 3, pad_id: int = 0
) -> np.ndarray:
    """bool per validation target (positions 1 .. len-1): does the n-gram ending at that
    target occur in the training stream? Positions before the stream's start read `pad_id`."""
    padded = np.concatenate([np.full(n - 1, pad_id, dtype=np.int64), np.asarray(val_tokens, dtype=np.int64)])
    keys = ngram_keys(padded, n, vocab_size)  # key i ends at val position i
    return member_of(keys[1:], stream_ngram_keys(train_tokens, n, vocab_size))
