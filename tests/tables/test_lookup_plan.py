"""The sync-free padded plan equals the plain steps it replaces (torch.unique, nonzero, split_by_density)."""

from __future__ import annotations

import pytest
import torch
from helpers import devices

from condmem.tables.lookup_plan import split_by_density
from condmem.tables.lookup_plan import (
    COUNT_NAMES,
    N_COUNTS,
    PAD_ID,
    LookupPlan,
    compact_padded,
    dedup_padded,
    split_padded,
)
from condmem.tables.row_cache import RowCache


def _ids(n: int, hi: int, seed: int) -> torch.Tensor:
    return torch.randint(0, hi, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("n,hi", [(1, 5), (7, 3), (1000, 50), (1000, 10**9), (4096, 4096)])
def test_dedup_padded_equals_torch_unique(device, n, hi):
    ids = _ids(n, hi, seed=n + hi).to(device)
    uniq, inverse, count = dedup_padded(ids)
    ref, ref_inv = torch.unique(ids, sorted=True, return_inverse=True)
    k = ref.numel()
    assert int(count) == k and uniq.shape == (n + 1,)
    assert torch.equal(uniq[:k], ref) and bool((uniq[k:] == PAD_ID).all())
    assert torch.equal(inverse, ref_inv)


@pytest.mark.parametrize("device", devices())
def test_compact_padded_equals_nonzero(device):
    for seed, p in ((0, 0.0), (1, 0.3), (2, 1.0)):
        mask = (torch.rand(777, generator=torch.Generator().manual_seed(seed)) < p).to(device)
        pos, count = compact_padded(mask, fill=777)
        ref = torch.nonzero(mask).flatten()
        assert int(count) == ref.numel()
        assert torch.equal(pos[: ref.numel()], ref) and bool((pos[ref.numel() :] == 777).all())


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("region_rows", [1, 4, 64])
def test_split_padded_equals_split_by_density(fraction, region_rows):
    row_bytes = 72
    miss = torch.unique(_ids(600, 5000, seed=3))
    n_miss = miss.numel()
    n = 900  # padded size > n_miss
    padded = torch.full((n + 1,), PAD_ID, dtype=torch.int64)
    padded[:n_miss] = miss
    gpu_sel, cpu_sel, n_gpu, n_cpu = split_padded(
        padded, torch.tensor([n_miss]), row_bytes, region_rows * row_bytes, fraction
    )
    ref_gpu, ref_cpu = split_by_density(miss, row_bytes, region_rows * row_bytes, int(round(n_miss * fraction)))
    assert (int(n_gpu), int(n_cpu)) == (ref_gpu.numel(), ref_cpu.numel())
    assert torch.equal(gpu_sel[: ref_gpu.numel()], ref_gpu) and bool((gpu_sel[ref_gpu.numel() :] == n).all())
    assert torch.equal(cpu_sel[: ref_cpu.numel()], ref_cpu) and bool((cpu_sel[ref_cpu.numel() :] == n).all())


def _rows(ids: torch.Tensor, row_bytes: int) -> torch.Tensor:
    return ((ids[:, None] * 131 + torch.arange(row_bytes, device=ids.device)) % 251).to(torch.uint8)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("cached", [False, True], ids=["nocache", "cache"])
@pytest.mark.parametrize("fraction", [0.0, 0.6, 1.0])
def test_plan_finds_hits_misses_and_shares_like_the_plain_steps(device, cached, fraction):
    """A plan run eagerly: hits already in `compact`, misses and shares as the plain steps make them,
    counts and the CPU share's ids in the host buffer; admission matches RowCache.admit."""
    row_bytes, num_rows, n = 16, 3000, 1200
    cache = plain = None
    if cached:
        cache = RowCache(512, row_bytes, ways=4, device=device)
        plain = RowCache(512, row_bytes, ways=4, device=device)
        warm = torch.unique(_ids(400, num_rows, seed=7)).to(device)
        for c in (cache, plain):
            c.admit(warm, _rows(warm, row_bytes))
    plan = LookupPlan(n, row_bytes, num_rows, torch.device(device), cache, fraction, 8 * row_bytes, pin=False)
    for seed in range(3):
        ids = _ids(n, num_rows, seed=10 + seed).to(device)
        plan.ids.copy_(ids)
        plan.compact.fill_(0xEE)  # poisoned
        plan.run()
        uniq, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        assert torch.equal(plan.inverse, inverse)
        slot = plain.probe(uniq) if cached else torch.full_like(uniq, -1)
        hit = slot >= 0
        hit_pos = torch.nonzero(hit).flatten()
        # row_of: a permutation of the compact rows, padding at N; each id's row is its unique id's.
        assert torch.equal(torch.sort(plan.row_of[:n]).values, torch.arange(n, device=device))
        assert int(plan.row_of[n]) == n and torch.equal(plan.rows_index, plan.row_of[inverse])
        if cached:
            assert torch.equal(plan.compact[plan.row_of[hit_pos]], plain.read(slot[hit]))
        miss_pos = torch.nonzero(~hit).flatten()
        k = miss_pos.numel()
        assert torch.equal(plan.miss_pos[:k], miss_pos) and torch.equal(plan.miss_ids[:k], uniq[miss_pos])
        counts = dict(zip(COUNT_NAMES, plan.host[:N_COUNTS].tolist()))
        ref_gpu, ref_cpu = split_by_density(uniq[miss_pos], row_bytes, 8 * row_bytes, int(round(k * fraction)))
        assert counts["n_miss"] == k and counts["n_unique"] == uniq.numel() and counts["bad"] == 0
        assert (counts["n_gpu"], counts["n_cpu"]) == (ref_gpu.numel(), ref_cpu.numel())
        assert torch.equal(plan.gpu_ids[: ref_gpu.numel()], uniq[miss_pos][ref_gpu])
        assert torch.equal(plan.gpu_dst[: ref_gpu.numel()], plan.row_of[miss_pos[ref_gpu]])
        assert (plan.gpu_dst[ref_gpu.numel() :] == n).all()
        # The CPU share takes compact rows 0..n_cpu-1 in its own order (its DMAs land in place).
        assert torch.equal(plan.row_of[miss_pos[ref_cpu]], torch.arange(ref_cpu.numel(), device=device))
        assert torch.equal(plan.host[N_COUNTS : N_COUNTS + ref_cpu.numel()].to(device), uniq[miss_pos][ref_cpu])
        if cached:
            # The misses' rows land (as the engine's shares would write them), then both caches admit.
            plan.compact[plan.row_of[miss_pos]] = _rows(uniq[miss_pos], row_bytes)
            plan.admit()
            plain.admit(uniq[miss_pos], _rows(uniq[miss_pos], row_bytes))
            assert torch.equal(cache.keys, plain.keys) and torch.equal(cache.freq, plain.freq)
            live = torch.nonzero(cache.keys.flatten() >= 0).flatten()
            assert torch.equal(cache.data[live], plain.data[live])
            assert cache.stats == plain.stats


@pytest.mark.parametrize("device", devices())
def test_plan_reports_ids_outside_the_table(device):
    plan = LookupPlan(5, 8, 100, torch.device(device), None, 1.0, 64, pin=False)
    plan.ids.copy_(torch.tensor([3, 99, 100, 3, 7]))
    plan.run()
    counts = dict(zip(COUNT_NAMES, plan.host[:N_COUNTS].tolist()))
    assert counts["bad"] == 1 and counts["max_id"] == 100 and counts["min_id"] == 3


def test_plan_buckets_bound_the_padding_and_keep_the_prefill_size():
    from condmem.tables.lookup_plan import plan_bucket

    for n in list(range(1, 300)) + [1000, 4097, 65535, 65536, 65537, 393_215, 393_216, 1 << 20]:
        b = plan_bucket(n)
        assert b >= n and (b - n) * 8 <= max(n, 16), (n, b)
    assert plan_bucket(16384 * 24) == 16384 * 24
    assert len({plan_bucket(n) for n in range(100_000, 200_001)}) <= 17  # few plans for many sizes


@pytest.mark.parametrize("cached", [False, True], ids=["nocache", "cache"])
def test_a_bucketed_plan_equals_the_plan_of_the_batch_alone(cached):
    """A batch in a bigger plan (tail filled with its first id) has the counts, misses, shares
    and inverse of a plan of its own size."""
    from condmem.tables.lookup_plan import fill_plan_ids

    row_bytes, num_rows, n = 16, 3000, 1000
    ids = _ids(n, num_rows, seed=31)
    plans = []
    for size in (n, 1152):
        cache = None
        if cached:
            cache = RowCache(512, row_bytes, ways=4)
            warm = torch.unique(_ids(400, num_rows, seed=7))
            cache.admit(warm, _rows(warm, row_bytes))
        plan = LookupPlan(size, row_bytes, num_rows, torch.device("cpu"), cache, 0.5, 8 * row_bytes, pin=False)
        fill_plan_ids(plan.ids, ids)
        plan.run()
        plans.append(plan)
    alone, bucketed = plans
    assert torch.equal(alone.host[:N_COUNTS], bucketed.host[:N_COUNTS])
    counts = dict(zip(COUNT_NAMES, alone.host[:N_COUNTS].tolist()))
    k, g, c = counts["n_miss"], counts["n_gpu"], counts["n_cpu"]
    assert torch.equal(alone.inverse, bucketed.inverse[:n])
    for name, m in (
        ("miss_ids", k),
        ("miss_pos", k),
        ("gpu_ids", g),
        ("gpu_dst", g),
        ("rows_index", n),
        ("row_of", counts["n_unique"]),
    ):
        assert torch.equal(getattr(alone, name)[:m], getattr(bucketed, name)[:m]), name
    assert c == int((alone.row_of[: counts["n_unique"]] < c).sum())
    hit = torch.ones(counts["n_unique"], dtype=torch.bool)
    hit[alone.miss_pos[:k]] = False
    hits = alone.row_of[: counts["n_unique"]][hit]  # the compact rows the cache filled
    assert torch.equal(alone.compact[hits], bucketed.compact[hits]) or not cached


@pytest.mark.parametrize("row_bytes", [8, 6, 7, 264, 12])
def test_move_rows_moves_exact_bytes_and_skips_padding(row_bytes):
    """4-byte words, 2-byte words, no words (odd rows)."""
    from condmem.tables.lookup_plan import move_rows

    gen = torch.Generator().manual_seed(row_bytes)
    src = torch.randint(0, 256, (20, row_bytes), generator=gen, dtype=torch.int32).to(torch.uint8)
    src[0] = 0xFF  # NaN bit patterns as float words move intact
    dst = torch.full((12, row_bytes), 0xEE, dtype=torch.uint8)
    src_index = torch.tensor([0, 5, 19, 3, -1])
    dst_index = torch.tensor([11, 0, 4, 12, -1])  # 12 and -1: outside dst (padding)
    move_rows(src, src_index, dst, dst_index)
    expect = torch.full_like(dst, 0xEE)
    expect[11], expect[0], expect[4] = src[0], src[5], src[19]
    assert torch.equal(dst, expect)


def test_move_rows_refuses_rows_of_different_sizes():
    from condmem.tables.lookup_plan import move_rows

    with pytest.raises(ValueError, match="source rows of 264 B, destination rows of 256 B"):
        move_rows(
            torch.zeros((4, 264), dtype=torch.uint8),
            torch.tensor([0]),
            torch.zeros((4, 256), dtype=torch.uint8),
            torch.tensor([0]),
        )
