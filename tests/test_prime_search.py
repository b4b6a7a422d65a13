"""The layout's prime search: linear in the primes, with exactly the primes of the plain search.

The reference below is the search the layout used before (and the released checkpoints were
built with): a deterministic Miller-Rabin test and, for every head, a walk up from the start
that skips taken primes. It restarts at ``table_size - 1`` for every order, so it re-walks
every prime the earlier layers took: quadratic in the number of primes.
"""

from __future__ import annotations

import time

import pytest

from condmem import EngramConfig, EngramLayout
from condmem.layout import PrimeSieve, draw_primes

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def reference_is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def reference_next_unused_prime(start: int, taken: set[int]) -> int:
    candidate = start + 1
    while candidate in taken or not reference_is_prime(candidate):
        candidate += 1
    return candidate


def reference_draw_primes(layer_ids, table_sizes, n_heads):
    taken: set[int] = set()
    per_layer = []
    for _ in layer_ids:
        columns = []
        for size in table_sizes:
            start = size - 1
            for _ in range(n_heads):
                p = reference_next_unused_prime(start, taken)
                taken.add(p)
                columns.append(p)
                start = p
        per_layer.append(columns)
    return per_layer


@pytest.mark.parametrize(
    "layer_ids, table_sizes, n_heads",
    [
        ([1, 14], [16_000_000] * 3, 8),  # V4.1-Flash
        ([0], [2], 1),
        ([0, 3], [2, 2, 3], 4),  # smallest sizes: later orders skip the first ones' primes
        ([0, 1, 2], [1000, 2000, 1500, 3000], 5),  # ranges that overlap across orders
        ([0, 1, 2, 3], [100, 97, 101, 50], 16),
        ([2, 1], [3000, 10, 3000, 10, 2999], 7),  # a start inside another order's run
        ([0, 1], [2**20 - 40, 2**20 - 3], 9),  # runs crossing a sieve window's edge
        ([5, 6], [2**40] * 5, 6),  # the largest table size
        (list(range(6)), [2**40 - 100, 2**40, 2**40 + 57], 4),
    ],
    ids=["v41", "one", "tiny", "overlap", "descending", "inside", "window-edge", "2^40", "2^40-mixed"],
)
def test_prime_search_equals_the_plain_search(layer_ids, table_sizes, n_heads):
    assert draw_primes(layer_ids, table_sizes, n_heads) == reference_draw_primes(layer_ids, table_sizes, n_heads)


@pytest.mark.parametrize("lo, hi", [(0, 5000), (2**20 - 3000, 2**20 + 3000), (2**40 - 2000, 2**40 + 2000)])
def test_sieve_next_prime_is_exact(lo, hi):
    sieve = PrimeSieve()
    expected = [n for n in range(lo, hi + 200) if reference_is_prime(n)]
    y = lo - 1
    for p in expected:
        if p > hi:
            break
        assert sieve.next_prime(y) == p
        assert sieve.next_prime(p - 1) == p
        y = p


@pytest.mark.parametrize("n_layers", [4, 64])
def test_largest_orders_and_heads_build_fast(n_layers):
    # N=32, 256 heads, 2**40-row ranges: 4 layers took 54 s with the per-order restart, 64 never finished.
    cfg = EngramConfig(
        layer_ids=list(range(n_layers)), max_ngram_size=32, n_heads=256, table_size=2**40, compressed_vocab_size=1000
    )
    t0 = time.perf_counter()
    layout = EngramLayout(cfg)
    elapsed = time.perf_counter() - t0
    assert elapsed < 5.0, f"{n_layers} layers took {elapsed:.1f} s"
    primes = [p for layer in layout.layers for p in layer.primes]
    assert len(primes) == n_layers * 31 * 256 == len(set(primes))
    assert min(primes) > 2**40 - 1
