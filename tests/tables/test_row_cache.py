"""RowCache: hits return exactly the admitted bytes, sets never overflow, frequent rows stay."""

from __future__ import annotations

import pytest
import torch
from helpers import devices

from condmem.tables.row_cache import RowCache


def _rows(ids: torch.Tensor, row_bytes: int) -> torch.Tensor:
    # Content derived from the id, so any mix-up of slots shows.
    return ((ids[:, None] * 131 + torch.arange(row_bytes, device=ids.device)) % 251).to(torch.uint8)


@pytest.mark.parametrize("device", devices())
def test_cached_reads_equal_the_backing_rows(device):
    gen = torch.Generator().manual_seed(0)
    cache = RowCache(capacity_rows=64, row_bytes=12, ways=4, device=device)
    for _ in range(30):
        ids = torch.unique(torch.randint(0, 300, (50,), generator=gen)).to(device)
        slot = cache.probe(ids)
        hit = slot >= 0
        assert torch.equal(cache.read(slot[hit]), _rows(ids[hit], 12))
        cache.admit(ids[~hit], _rows(ids[~hit], 12))
        # Every key appears at most once, and every key's bytes match its id.
        keys = cache.keys.flatten()
        live = keys[keys >= 0]
        assert live.unique().numel() == live.numel()
        slots = torch.nonzero(keys >= 0).flatten()
        assert torch.equal(cache.data[slots], _rows(live, 12))
    s = cache.stats
    assert s.lookups > 0 and 0 < s.hits < s.lookups


@pytest.mark.parametrize("device", devices())
def test_burst_into_one_set_does_not_overflow(device):
    cache = RowCache(capacity_rows=8, row_bytes=4, ways=4, device=device)  # 2 sets
    ids = torch.arange(0, 20, 2, device=device)  # all in set 0
    slot = cache.admit(ids, _rows(ids, 4))
    assert int((slot >= 0).sum()) == 4
    assert (slot[slot >= 0] < 4).all()  # only set 0's ways
    # The dropped ids went nowhere visible: not probed, not in the keys, and the kept ones
    # read back their own bytes.
    assert torch.equal(cache.probe(ids, count=False), slot)
    assert int((cache.keys >= 0).sum()) == 4 and cache.keys.numel() == 8
    kept = slot >= 0
    assert torch.equal(cache.read(slot[kept]), _rows(ids[kept], 4))


def test_frequent_rows_survive_a_scan():
    cache = RowCache(capacity_rows=16, row_bytes=4, ways=4, decay_every=0)
    hot = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    cache.admit(hot, _rows(hot, 4))
    for _ in range(5):
        assert (cache.probe(hot) >= 0).all()
    for start in range(100, 400, 8):  # a one-off scan of cold rows
        cold = torch.arange(start, start + 8)
        slot = cache.probe(cold)
        cache.admit(cold[slot < 0], _rows(cold[slot < 0], 4))
    assert (cache.probe(hot, count=False) >= 0).all()


def test_bad_admit_shapes():
    cache = RowCache(capacity_rows=8, row_bytes=4)
    with pytest.raises(ValueError, match="uint8"):
        cache.admit(torch.tensor([1]), torch.zeros(1, 5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="positive"):
        RowCache(0, 4)


def test_admitting_a_cached_id_again_keeps_one_copy():
    cache = RowCache(capacity_rows=16, row_bytes=4, ways=4)
    ids = torch.tensor([3, 7, 11])
    cache.admit(ids, _rows(ids, 4))
    again = torch.tensor([7, 19])
    slot = cache.admit(again, _rows(again, 4))
    assert slot[0] == -1 and slot[1] >= 0
    keys = cache.keys.flatten()
    assert int((keys == 7).sum()) == 1


@pytest.mark.parametrize("device", devices())
def test_a_set_with_empty_ways_never_evicts_a_live_row(device):
    # Counters decay to 0, but a live row still outranks an empty way: while a set has room,
    # admitting never drops what it holds (the bug this guards: decayed rows were evicted first).
    cache = RowCache(capacity_rows=8, row_bytes=4, ways=8, device=device, decay_every=1)  # one set
    held = []
    for i in range(8):
        ids = torch.tensor([i], device=device)
        assert int(cache.admit(ids, _rows(ids, 4))[0]) >= 0
        held.append(i)
        assert (cache.probe(torch.tensor(held, device=device), count=False) >= 0).all(), held
