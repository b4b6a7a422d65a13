"""The RowCache's Triton kernels (probe, admission) against its torch ops, step by step on random
traces: the same slots, keys, counters, rows and statistics. Traces mix skewed repeats, padding,
bursts into one set (more newcomers than ways), ids admitted while already cached, counter decay,
rows read in place through an index, and row widths of 8-, 4- and 2-byte words.

CPU runs the kernels through the interpreter (TRITON_INTERPRET=1); a GPU runs them compiled.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import kernel_devices, kernel_devices_here, needs_kernels

from condmem.tables.row_cache import RowCache

pytestmark = needs_kernels
DEVICES = kernel_devices()


def _pair(device, capacity, row_bytes, ways, decay_every):
    return [
        RowCache(capacity, row_bytes, ways=ways, device=device, decay_every=decay_every, backend=b)
        for b in ("torch", "triton")
    ]


def _assert_same_state(ref: RowCache, got: RowCache, step: str) -> None:
    assert torch.equal(ref.keys, got.keys), f"{step}: keys differ"
    assert torch.equal(ref.freq, got.freq), f"{step}: counters differ"
    live = ref.keys.flatten() >= 0
    assert torch.equal(ref.data[live], got.data[live]), f"{step}: cached rows differ"
    assert ref.stats == got.stats, f"{step}: statistics differ"


def _rows(ids: torch.Tensor, row_bytes: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (ids.numel(), row_bytes), generator=gen, dtype=torch.int32).to(torch.uint8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("row_bytes,ways,capacity", [(264, 16, 256), (12, 4, 64), (6, 8, 40)])
def test_kernels_match_the_torch_ops(device, row_bytes, ways, capacity):
    gen = torch.Generator().manual_seed(row_bytes * 31 + ways)
    ref, got = _pair(device, capacity, row_bytes, ways, decay_every=3)
    universe = 6 * capacity
    for step in range(12):
        # Skewed draws (small ids are frequent), unique and sorted, then padding as a plan lays it out.
        draw = (torch.rand(3 * capacity, generator=gen) ** 3 * universe).long()
        uniq = torch.unique(draw)
        n_pad = int(torch.randint(0, 20, (1,), generator=gen))
        ids = torch.cat([uniq, torch.full((n_pad,), -1)]).to(device)
        valid = ids >= 0
        slot_ref = ref.probe(ids, valid=valid)
        slot_got = got.probe(ids, valid=valid)
        assert torch.equal(slot_ref, slot_got), f"step {step}: probe slots differ"
        hit = slot_ref >= 0
        assert torch.equal(got.read(slot_got[hit]), ref.read(slot_ref[hit])), f"step {step}: hit rows differ"
        _assert_same_state(ref, got, f"step {step} probe")

        # The misses, padded, their rows read in place from a shuffled source buffer; every other
        # step a few ids that are already cached come along (they must not be admitted twice).
        miss = ids[valid & ~hit]
        if step % 2 and hit.any():
            miss = torch.cat([miss, ids[hit][:3]])
        newcomers = torch.cat([miss, torch.full((n_pad,), -1, device=device)])
        source = _rows(newcomers, row_bytes, gen).to(device)
        row_index = torch.randperm(newcomers.numel(), generator=gen).to(device)
        source_rows = torch.empty_like(source)
        source_rows[row_index] = source
        kept_ref, kept = (
            c.admit_rows(newcomers, source_rows, valid=newcomers >= 0, row_index=row_index) for c in (ref, got)
        )
        for c in (ref, got):
            c.note_admission()
        assert torch.equal(kept_ref, kept), f"step {step}: admitted slots differ"
        assert (kept[newcomers < 0] == -1).all()
        _assert_same_state(ref, got, f"step {step} admit")
        admitted = kept >= 0
        assert torch.equal(got.read(kept[admitted]), source[admitted]), f"step {step}: admitted rows differ"


@pytest.mark.parametrize("device", DEVICES)
def test_burst_into_one_set_takes_at_most_every_way(device):
    ref, got = _pair(device, capacity=8, row_bytes=16, ways=4, decay_every=0)  # 2 sets
    gen = torch.Generator().manual_seed(5)
    first = torch.tensor([0, 2, 4], device=device)  # set 0, one way left empty
    for cache in (ref, got):
        cache.admit(first, _rows(first, 16, gen).to(device))
        cache.probe(torch.tensor([2], device=device))  # id 2 becomes the most frequent
    burst = torch.arange(10, 30, 2, device=device)  # 10 newcomers for set 0
    rows = _rows(burst, 16, gen).to(device)
    slots = [cache.admit(burst, rows) for cache in (ref, got)]
    assert torch.equal(slots[0], slots[1])
    assert int((slots[1] >= 0).sum()) == 4
    _assert_same_state(ref, got, "burst")
    # Ranks 0-3 (the first four of the burst, in batch order) took every way, the empty one first.
    assert sorted(got.keys[0].tolist()) == burst[:4].tolist()
    assert (got.keys[1] == -1).all()


def test_triton_backend_needs_power_of_two_ways():
    with pytest.raises(ValueError, match="power-of-two number of ways"):
        RowCache(12, 8, ways=3, device=(kernel_devices_here() or ["cpu"])[0], backend="triton")
