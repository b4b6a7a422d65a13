"""NgramHasher against an independent scalar oracle written from the reference note.

The oracle below uses Python ints, one position / layer / order / head at a time,
trial-division primes, and the note's wording of padding and blocking; it shares no
code with the vectorized hasher. Integer results are compared exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from condmem import EngramConfig, EngramLayout, HashInputError, NgramHasher
from helpers import available_devices

# ---------------------------------------------------------------------------- oracle


def _slow_is_prime(n: int) -> bool:
    if n < 2:
        return False
    d = 2
    while d * d <= n:
        if n % d == 0:
            return False
        d += 1
    return True


def oracle_primes(layer_ids, table_sizes, n_heads):
    seen: set[int] = set()
    out = {}
    for lid in layer_ids:
        cols = []
        for size in table_sizes:
            start = size - 1
            for _ in range(n_heads):
                p = start + 1
                while p in seen or not _slow_is_prime(p):
                    p += 1
                seen.add(p)
                cols.append(p)
                start = p
        out[lid] = cols
    return out


def oracle_multipliers(layer_id, max_n, vocab, seed):
    bound = max(1, (2**63 - 1) // vocab // 2)
    r = np.random.default_rng(seed + 10007 * layer_id).integers(0, bound, size=max_n, dtype=np.int64)
    return [2 * int(x) + 1 for x in r]


def oracle_rows(token_ids, blocked, lookup, cfg: EngramConfig, vocab: int, with_offsets=True):
    """[B][T][L][cols] nested lists, one scalar at a time."""
    primes = oracle_primes(cfg.layer_ids, cfg.table_sizes, cfg.n_heads)
    pad = lookup[cfg.pad_id]
    out = []
    for b, row in enumerate(token_ids):
        c = [lookup[t] for t in row]
        seq = []
        for t in range(len(c)):

            def back(k):
                if t - k < 0:
                    return pad
                for j in range(1, k + 1):  # a block at t-j hides t-j and everything older
                    if blocked is not None and blocked[b][t - j]:
                        return pad
                return c[t - k]

            per_layer = []
            for lid in cfg.layer_ids:
                m = oracle_multipliers(lid, cfg.max_ngram_size, vocab, cfg.seed)
                cols = []
                offset = 0
                for n in range(2, cfg.max_ngram_size + 1):
                    mix = 0
                    for k in range(n):
                        mix ^= back(k) * m[k]
                    assert 0 <= mix < 2**63
                    for h in range(cfg.n_heads):
                        p = primes[lid][(n - 2) * cfg.n_heads + h]
                        cols.append(mix % p + (offset if with_offsets else 0))
                        offset += p
                per_layer.append(cols)
            seq.append(per_layer)
        out.append(seq)
    return out


# ---------------------------------------------------------------------------- property tests

configs = st.builds(
    dict,
    max_n=st.integers(2, 5),
    heads=st.integers(1, 8),
    per_order=st.booleans(),
    sizes=st.lists(st.integers(2, 400), min_size=4, max_size=4),
    layers=st.lists(st.integers(0, 40), min_size=1, max_size=3, unique=True),
    vocab=st.sampled_from([2, 3, 17, 1000, 99_092, 2**20 + 7]),
    seed=st.integers(0, 3),
    batch=st.integers(1, 3),
    length=st.integers(1, 11),
    blocked=st.booleans(),
)


def _build(p, gen):
    sizes = p["sizes"][: p["max_n"] - 1] if p["per_order"] else p["sizes"][0]
    tok_vocab = p["vocab"] + int(gen.integers(0, 50))
    # Random surjective map token id -> compressed id.
    lookup = np.concatenate([np.arange(p["vocab"]), gen.integers(0, p["vocab"], tok_vocab - p["vocab"])])
    gen.shuffle(lookup)
    cfg = EngramConfig(
        layer_ids=p["layers"],
        max_ngram_size=p["max_n"],
        n_heads=p["heads"],
        head_dim=4,
        table_size=sizes,
        pad_id=int(gen.integers(0, tok_vocab)),
        seed=p["seed"],
        compressed_vocab_size=p["vocab"],
    )
    return cfg, lookup, tok_vocab


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=configs, data_seed=st.integers(0, 2**32 - 1))
def test_hasher_equals_scalar_oracle(p, data_seed):
    gen = np.random.default_rng(data_seed)
    cfg, lookup, tok_vocab = _build(p, gen)
    hasher = NgramHasher(EngramLayout(cfg), token_lookup=lookup)
    ids = gen.integers(0, tok_vocab, size=(p["batch"], p["length"]))
    blocked = gen.random((p["batch"], p["length"])) < 0.25 if p["blocked"] else None
    expect_rows = oracle_rows(
        ids.tolist(), None if blocked is None else blocked.tolist(), lookup.tolist(), cfg, p["vocab"]
    )
    expect_buckets = oracle_rows(
        ids.tolist(),
        None if blocked is None else blocked.tolist(),
        lookup.tolist(),
        cfg,
        p["vocab"],
        with_offsets=False,
    )
    blocked_t = None if blocked is None else torch.from_numpy(blocked)
    for device in available_devices():
        x = torch.from_numpy(ids).to(device)
        b = None if blocked_t is None else blocked_t.to(device)
        rows = hasher(x, blocked=b)
        assert rows.dtype == torch.int64 and rows.shape == (p["batch"], p["length"], len(p["layers"]), cfg.n_cols)
        assert torch.equal(rows.cpu(), torch.tensor(expect_rows, dtype=torch.int64))
        assert torch.equal(
            hasher(x, blocked=b, with_offsets=False).cpu(), torch.tensor(expect_buckets, dtype=torch.int64)
        )


def test_layout_matches_oracle_primes_and_multipliers():
    cfg = EngramConfig(
        layer_ids=[3, 0, 7],
        max_ngram_size=4,
        n_heads=5,
        table_size=[50, 50, 20],
        head_dim=4,
        compressed_vocab_size=777,
        seed=2,
    )
    layout = EngramLayout(cfg)
    primes = oracle_primes(cfg.layer_ids, cfg.table_sizes, cfg.n_heads)
    for layer in layout.layers:
        assert list(layer.primes) == primes[layer.layer_id]
        assert list(layer.multipliers) == oracle_multipliers(layer.layer_id, 4, 777, 2)
        assert list(layer.offsets) == list(np.cumsum([0] + primes[layer.layer_id][:-1]))
    # No prime is used twice anywhere in the model.
    flat = [p for layer in layout.layers for p in layer.primes]
    assert len(set(flat)) == len(flat)


def test_v41_flash_geometry():
    layout = EngramLayout(EngramConfig.deepseek_v41_flash())
    assert layout.num_embeddings == [384006168, 384016682]
    assert layout.n_cols == 24
    assert layout.n_params == (384006168 + 384016682) * 256
    # Trial-division oracle agrees with the Miller-Rabin primes at full size.
    assert [list(l.primes) for l in layout.layers] == list(oracle_primes([1, 14], [16_000_000] * 3, 8).values())
    assert layout.bytes_per_layer("fp8")[0] == 384006168 * (256 + 8)


def test_v41_rows_on_a_long_sequence_match_oracle():
    """V4.1 constants (V'=99,092, 16M-prime tables) at a length where every look-back is real."""
    cfg = EngramConfig.deepseek_v41_flash()
    gen = np.random.default_rng(0)
    lookup = np.arange(99_092)
    hasher = NgramHasher(EngramLayout(cfg), token_lookup=lookup)
    ids = gen.integers(0, 99_092, size=(2, 40))
    got = hasher(torch.from_numpy(ids))
    assert torch.equal(got, torch.tensor(oracle_rows(ids.tolist(), None, lookup.tolist(), cfg, 99_092)))
    assert int(got.max()) < 384016682


def test_doc_starts_equal_hashing_each_document_alone():
    cfg = EngramConfig(
        layer_ids=[1, 4], max_ngram_size=4, n_heads=3, table_size=97, head_dim=4, compressed_vocab_size=50
    )
    hasher = NgramHasher(EngramLayout(cfg))
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 50, (1, n), generator=gen) for n in (5, 1, 7, 2)]
    packed = torch.cat(docs, dim=1)
    starts = torch.zeros_like(packed, dtype=torch.bool)
    pos = 0
    for d in docs:
        starts[0, pos] = True
        pos += d.shape[1]
    got = hasher(packed, doc_starts=starts)
    expect = torch.cat([hasher(d) for d in docs], dim=1)
    assert torch.equal(got, expect)


def test_length_one_and_empty():
    cfg = EngramConfig(layer_ids=[1], max_ngram_size=3, n_heads=2, table_size=31, head_dim=4, compressed_vocab_size=10)
    hasher = NgramHasher(EngramLayout(cfg))
    one = hasher(torch.tensor([[4]]))
    assert one.shape == (1, 1, 1, 4)
    assert hasher(torch.zeros((3, 0), dtype=torch.long)).shape == (3, 0, 1, 4)


# ---------------------------------------------------------------------------- bad input


@pytest.fixture
def small_hasher():
    cfg = EngramConfig(layer_ids=[1], max_ngram_size=3, n_heads=2, table_size=31, head_dim=4, compressed_vocab_size=5)
    lookup = np.array([0, 1, 2, 3, 4, 0, 1])  # 7 token ids onto 5 compressed ids
    return NgramHasher(EngramLayout(cfg), token_lookup=lookup)


def test_ids_outside_the_tokenizer_are_named(small_hasher):
    with pytest.raises(HashInputError, match="token id 7 is outside the tokenizer's ids 0..6"):
        small_hasher(torch.tensor([[1, 7]]))
    with pytest.raises(HashInputError, match="token id -1"):
        small_hasher(torch.tensor([[-1, 2]]))


def test_wrong_rank_and_dtype(small_hasher):
    with pytest.raises(HashInputError, match=r"\[B, T\].*unsqueeze"):
        small_hasher(torch.tensor([1, 2]))
    with pytest.raises(HashInputError, match="integer token ids"):
        small_hasher(torch.tensor([[1.0, 2.0]]))
    with pytest.raises(HashInputError, match="must be a torch.Tensor"):
        small_hasher([[1, 2]])
    with pytest.raises(HashInputError, match="blocked must be a bool"):
        small_hasher(torch.tensor([[1, 2]]), blocked=torch.tensor([[0, 1]]))
    with pytest.raises(HashInputError, match="blocked has shape"):
        small_hasher(torch.tensor([[1, 2]]), blocked=torch.tensor([[True]]))


def test_lookup_that_disagrees_with_layout_vocab():
    cfg = EngramConfig(layer_ids=[1], max_ngram_size=3, n_heads=2, table_size=31, head_dim=4, compressed_vocab_size=6)
    with pytest.raises(HashInputError, match="silently rehashed"):
        NgramHasher(EngramLayout(cfg), token_lookup=np.array([0, 1, 2, 3, 4, 0]))


def test_pending_id_checks_read_ranges_with_or_without_the_boundary_column():
    from condmem.hashing.id_checks import PendingIdChecks

    checks = PendingIdChecks(HashInputError, bound=10, what="table", noun="row id")
    checks.submit(torch.tensor([[9, 0]]), "ok pair")
    checks.submit(torch.tensor([[3, 0, 0], [9, 0, 0]], dtype=torch.int32), "ok triple")
    with pytest.raises(HashInputError, match="row id 12 is outside the table's ids 0..9 .a lookup"):
        checks.submit(torch.tensor([[12, 0]]), "a lookup")
    with pytest.raises(HashInputError, match="row id -2 is outside"):
        checks.submit(torch.tensor([[4, 2]]), "negative")
    with pytest.raises(HashInputError, match="cu_seqlens"):
        checks.submit(torch.tensor([[1, 0, 1]]), "boundaries")
