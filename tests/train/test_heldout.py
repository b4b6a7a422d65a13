"""Near-duplicate validation documents and seen/unseen n-gram buckets, against plain Python sets."""

from __future__ import annotations

import numpy as np
import pytest

from condmem.train.heldout import member_of, near_duplicate_fractions, ngram_keys, seen_in_training


def _ngrams(tokens, n):
    return [tuple(int(x) for x in tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


@pytest.mark.parametrize("n, vocab", [(1, 50), (2, 50), (3, 50), (3, 129_280), (5, None), (13, None)])
def test_ngram_keys_identify_ngrams(n, vocab):
    rng = np.random.default_rng(n)
    tokens = rng.integers(0, vocab or 50, size=400)
    keys = ngram_keys(tokens, n, vocab)
    grams = _ngrams(tokens, n)
    assert len(keys) == len(grams)
    by_gram: dict = {}
    for g, k in zip(grams, keys):
        assert by_gram.setdefault(g, k) == k
    assert len(set(by_gram.values())) == len(by_gram), "distinct n-grams, distinct keys"
    assert len(ngram_keys(tokens[: n - 1], n, vocab)) == 0


def test_member_of_matches_a_set():
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 1000, size=5000).astype(np.uint64)
    queries = rng.integers(0, 1500, size=700).astype(np.uint64)
    expect = np.array([q in set(stream.tolist()) for q in queries.tolist()])
    assert np.array_equal(member_of(queries, stream), expect)
    assert member_of(np.zeros(0, np.uint64), stream).shape == (0,)
    assert not member_of(queries, np.zeros(0, np.uint64)).any()


def test_near_duplicate_fractions():
    rng = np.random.default_rng(1)
    train = rng.integers(0, 500, size=3000)
    copy = train[1000:1200].copy()
    half = np.concatenate([train[2000:2060], rng.integers(500, 900, size=60)])
    fresh = rng.integers(500, 900, size=100)
    tiny = train[:5]
    fr = near_duplicate_fractions(train, [copy, half, fresh, tiny], n=13)
    assert fr[0] == 1.0 and fr[2] == 0.0 and fr[3] == 0.0
    grams = set(_ngrams(train, 13))
    hg = _ngrams(half, 13)
    assert fr[1] == pytest.approx(sum(g in grams for g in hg) / len(hg))


def test_seen_in_training_uses_the_trigram_ending_at_each_target():
    train = np.array([5, 6, 7, 8, 5, 6, 9])
    val = np.array([5, 6, 7, 1, 6, 9])
    seen = seen_in_training(train, val, vocab_size=10, n=3, pad_id=0)
    # targets: 6 (0,5,6)? no; 7 (5,6,7) yes; 1 (6,7,1) no; 6 (7,1,6) no; 9 (1,6,9) no
    assert seen.tolist() == [False, True, False, False, False]
    train_grams = set(_ngrams(train, 3))
    rng = np.random.default_rng(2)
    train, val = rng.integers(0, 8, size=2000), rng.integers(0, 8, size=300)
    seen = seen_in_training(train, val, vocab_size=8)
    padded = [0, 0] + val.tolist()
    train_grams = set(_ngrams(train, 3))
    assert seen.tolist() == [tuple(padded[i : i + 3]) in train_grams for i in range(1, len(val))]
