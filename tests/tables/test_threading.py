"""Threads sharing one `EngramMemory`, `LookupEngine`, `RowCache` or store: every thread's rows equal
a plain single-threaded gather of the table (torch.equal), on every tier; with the locks taken out
(the negative controls) the same checker sees threads served other lookups' rows.

Each round starts all threads at a barrier, so their calls interleave as much as they can. Every
tier runs 8 threads x 200 lookups; the `slow` variant runs 8 x 1000 on the host tier (pageable) and
the disk tier with a DRAM cache (the one that failed most often without the locks). On a GPU every
tier runs 8 x 1000 small lookups on the direct path (HBM, page-locked host) and 8 x 200 on the
pipelined path (8,400 ids, or a disk table)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from condmem import EngramConfig, EngramLayout
from condmem.serving import EngramMemory
from condmem.hashing import NgramHasher
from condmem.tables.lookup import LookupConfig, LookupEngine
from condmem.tables.row_cache import RowCache
from condmem.tables.storage import place_layer
from condmem.tables.table_file import EngramTableFile, LayerRows, write_table_file

THREADS = 8
HEAD_DIM = 32
ROW_BYTES = 2 * HEAD_DIM  # bf16
CACHE_ROWS = 32  # two sets of 16 ways: most lookups evict rows another thread may be reading

CPU_TIERS = {
    "host-pageable": dict(tier="host", host_alloc="pageable"),
    "host-mmap_register": dict(tier="host", host_alloc="mmap_register"),
    "host-shared": dict(tier="host", host_alloc="shared"),
    "host-pageable-cache": dict(tier="host", host_alloc="pageable", cache_bytes=CACHE_ROWS * ROW_BYTES),
    "disk": dict(tier="disk"),
    "disk-dram_cache": dict(tier="disk", dram_cache_bytes=CACHE_ROWS * ROW_BYTES),
    "disk-direct_io": dict(tier="disk", direct_io=True),
    "disk-direct_io-dram_cache": dict(tier="disk", direct_io=True, dram_cache_bytes=CACHE_ROWS * ROW_BYTES),
}
GPU_TIERS = {
    "hbm": dict(tier="hbm"),
    "host-mmap_register": dict(tier="host", host_alloc="mmap_register"),
    "host-cuda_host_alloc": dict(tier="host", host_alloc="cuda_host_alloc"),
    "host-hbm_cache": dict(tier="host", host_alloc="mmap_register", cache_bytes=CACHE_ROWS * ROW_BYTES),
    "disk-dram_cache-hbm_cache": dict(
        tier="disk", dram_cache_bytes=CACHE_ROWS * ROW_BYTES, cache_bytes=CACHE_ROWS * ROW_BYTES
    ),
    "disk-direct_io": dict(tier="disk", direct_io=True),
}
FULL_SIZE = ["host-pageable", "disk-dram_cache"]  # 8 x 1000 (slow)


class _NoLock:
    """A lock that locks nothing: the negative controls put it where the locks were."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def acquire(self, *args, **kwargs):
        return True

    def release(self):
        pass


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """A two-layer bf16 table file: (path, hasher, {layer: rows}, O_DIRECT supported here)."""
    cfg = EngramConfig(
        layer_ids=[1, 2],
        max_ngram_size=3,
        n_heads=2,
        head_dim=HEAD_DIM,
        table_size=[101, 103],
        compressed_vocab_size=50,
        hidden_size=32,
    )
    layout = EngramLayout(cfg)
    gen = torch.Generator().manual_seed(0)
    weights = {
        lid: torch.randn(layout.layer(lid).num_embeddings, HEAD_DIM, generator=gen).to(torch.bfloat16)
        for lid in cfg.layer_ids
    }
    folder = tmp_path_factory.mktemp("threading")
    path = folder / "tables.safetensors"
    write_table_file(path, layout, "bf16", {lid: [LayerRows("bf16", w)] for lid, w in weights.items()})
    probe = folder / "probe"
    probe.write_bytes(b"\0" * 8192)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        direct_ok = True
    except OSError:
        direct_ok = False
    return path, NgramHasher(layout), weights, direct_ok


def _skip_unsupported(options: dict, direct_ok: bool) -> None:
    if options.get("direct_io") and not direct_ok:
        pytest.skip("this file system refuses O_DIRECT")
    if options.get("host_alloc") == "shared" and not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")


def _hammer(work: list[list], step) -> tuple[list[list], list]:
    """`step(t, x)` for every x of `work[t]` on thread t, all threads released together at each round;
    returns each call's result (None where it raised) and the errors raised."""
    barrier = threading.Barrier(len(work), timeout=120)
    results = [[None] * len(w) for w in work]
    errors: list = []

    def run(t: int) -> None:
        for i, x in enumerate(work[t]):
            barrier.wait()
            try:
                results[t][i] = step(t, x)
            except Exception as exc:  # noqa: BLE001 - counted by the checker
                errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,), daemon=True) for t in range(len(work))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not any(thread.is_alive() for thread in threads), "a thread never finished"
    return results, errors


def _row_batches(hasher: NgramHasher, n: int, seed: int, tokens: int = 2) -> list[torch.Tensor]:
    """`n` batches of row ids [1, tokens, n_layers, n_cols], each layer's ids in its table (repeats included)."""
    gen = torch.Generator().manual_seed(seed)
    layout = hasher.layout
    return [
        torch.stack(
            [
                torch.randint(0, layout.layer(lid).num_embeddings, (1, tokens, hasher.n_cols), generator=gen)
                for lid in hasher.layer_ids
            ],
            dim=2,
        )
        for _ in range(n)
    ]


def _check_memory(memory: EngramMemory, hasher, weights, lookups: int, tokens: int = 2) -> tuple[int, int]:
    """THREADS threads x `lookups` `memory.lookup` calls: (lookups whose rows differ from a plain gather
    of the table, lookups that raised)."""
    work = [_row_batches(hasher, lookups, seed=100 + t, tokens=tokens) for t in range(THREADS)]
    device = memory.device
    streams = [torch.cuda.Stream(device) if device.type == "cuda" else None for _ in range(THREADS)]

    def step(t: int, ids: torch.Tensor) -> dict:
        if streams[t] is None:
            prepared = memory.lookup(ids.to(device))
            return {lid: prepared.rows(lid) for lid in hasher.layer_ids}
        with torch.cuda.stream(streams[t]):  # each thread on a stream of its own, as a serving thread would be
            prepared = memory.lookup(ids.to(device))
            return {lid: prepared.rows(lid).cpu() for lid in hasher.layer_ids}

    results, errors = _hammer(work, step)
    wrong = 0
    for t in range(THREADS):
        for ids, got in zip(work[t], results[t]):
            if got is None:
                continue
            expect = {lid: weights[lid][ids[:, :, k]] for k, lid in enumerate(hasher.layer_ids)}
            wrong += any(not torch.equal(got[lid], expect[lid]) for lid in hasher.layer_ids)
    return wrong, len(errors)


def _open(table, options: dict, device: str = "cpu") -> EngramMemory:
    path, hasher, _, direct_ok = table
    _skip_unsupported(options, direct_ok)
    return EngramMemory.from_table_file(path, hasher, device=device, progress=False, **options)


def _run_tier(table, options: dict, lookups: int, device: str = "cpu", tokens: int = 2) -> None:
    _, hasher, weights, _ = table
    memory = _open(table, options, device)
    try:
        wrong, failed = _check_memory(memory, hasher, weights, lookups, tokens)
    finally:
        memory.close()
    assert (wrong, failed) == (0, 0), f"{wrong} lookups of {THREADS * lookups} wrong, {failed} raised"


# ---------------------------------------------------------------------- EngramMemory, every tier
@pytest.mark.parametrize("tier", list(CPU_TIERS))
def test_threads_sharing_a_memory_get_their_own_rows(table, tier):
    _run_tier(table, CPU_TIERS[tier], 200)


@pytest.mark.slow
@pytest.mark.parametrize("tier", FULL_SIZE)
def test_threads_sharing_a_memory_get_their_own_rows_full_size(table, tier):
    _run_tier(table, CPU_TIERS[tier], 1000)


@pytest.mark.gpu
@pytest.mark.parametrize("tier", list(GPU_TIERS))
@pytest.mark.parametrize("tokens", [2, 2100], ids=["direct", "pipelined"])  # 2100 x 4 ids: past direct_max_ids
def test_threads_sharing_a_cuda_memory_get_their_own_rows(table, tier, tokens):
    direct = tokens == 2 and GPU_TIERS[tier]["tier"] != "disk"  # the disk tier's lookups are all pipelined
    _run_tier(table, GPU_TIERS[tier], 1000 if direct else 200, "cuda", tokens)


def test_negative_control_a_memory_without_its_locks_serves_other_lookups_rows(table):
    """The same checker, the locks of the memory, its engines and caches replaced by no-ops: threads
    get rows of other threads' lookups (or fail), on the disk tier with a DRAM cache."""
    _, hasher, weights, _ = table
    memory = _open(table, CPU_TIERS["disk-dram_cache"])
    try:
        memory._lock = _NoLock()
        for lid, engine in memory.engines.items():
            engine._lock = _NoLock()
            memory.stores[lid].cache.lock = _NoLock()
        wrong, failed = _check_memory(memory, hasher, weights, 100)
    finally:
        memory.close()
    assert wrong > 0, f"no wrong rows without the locks ({failed} lookups raised)"


# ---------------------------------------------------------------------- LookupEngine
def _check_two_engines(table, own_locks: bool) -> tuple[int, int]:
    """THREADS threads x 200 lookups, alternately through two CPU engines that share one `RowCache`
    (`own_locks`: each engine given a lock of its own instead of the cache's): (wrong, raised)."""
    path, hasher, weights, _ = table
    store = place_layer(EngramTableFile(path, layout=hasher.layout).layer(1), "disk", progress=False)
    # Direct-mapped: an admission replaces the one way of its set, which another engine may just have
    # probed a hit in (a frequency-ranked set would spare the row a probe just counted).
    cache = RowCache(128, ROW_BYTES, ways=1)
    engines = [LookupEngine(store, "cpu", cache=cache) for _ in range(2)]
    if own_locks:
        for engine in engines:
            engine._lock = threading.RLock()
    work = [[ids[:, :, 0] for ids in _row_batches(hasher, 200, seed=200 + t, tokens=16)] for t in range(THREADS)]
    try:
        results, errors = _hammer(work, lambda t, ids: engines[t % 2].lookup(ids).wait())
    finally:
        for engine in engines:
            engine.close()
        store.close()
    assert cache.stats.hits > 0
    wrong = sum(
        got is not None and not torch.equal(got, weights[1][ids])
        for t in range(THREADS)
        for ids, got in zip(work[t], results[t])
    )
    return wrong, len(errors)


def test_two_engines_sharing_a_cache_and_threads_get_their_own_rows(table):
    """Engines that share one `RowCache` take turns on its lock: no admission of one between another's
    probe and its read of the hits."""
    wrong, failed = _check_two_engines(table, own_locks=False)
    assert (wrong, failed) == (0, 0), f"{wrong} of {THREADS * 200} lookups wrong, {failed} raised"


def test_negative_control_engines_sharing_a_cache_with_locks_of_their_own_read_other_rows(table):
    wrong, failed = _check_two_engines(table, own_locks=True)
    assert wrong > 0, f"no wrong rows with a lock per engine ({failed} lookups raised)"


@pytest.mark.gpu
def test_handles_of_interleaved_cuda_lookups_deliver_their_own_rows(table):
    """The pipelined GPU path (no direct reads), HBM cache: each thread keeps 3 lookups in flight and
    waits for them oldest first, on a stream of its own, while the other threads' lookups are planned
    between them."""
    path, hasher, weights, _ = table
    store = place_layer(EngramTableFile(path, layout=hasher.layout).layer(1), "host", progress=False)
    cache = RowCache(CACHE_ROWS, ROW_BYTES, ways=16, device="cuda")
    engine = LookupEngine(store, "cuda", cache=cache, config=LookupConfig(direct_max_ids=0))
    work = [[ids[:, :, 0] for ids in _row_batches(hasher, 300, seed=300 + t, tokens=64)] for t in range(THREADS)]
    streams = [torch.cuda.Stream() for _ in range(THREADS)]
    in_flight: list[list] = [[] for _ in range(THREADS)]

    def step(t, ids):
        with torch.cuda.stream(streams[t]):
            in_flight[t].append((ids, engine.lookup(ids.cuda())))
            last = ids is work[t][-1]
            done = []
            while len(in_flight[t]) >= 3 or (last and in_flight[t]):
                ids_, handle = in_flight[t].pop(0)
                done.append((ids_, handle.wait().cpu()))
            return done

    results, errors = _hammer(work, step)
    assert not errors, errors[:3]
    served = [pair for per_thread in results for done in per_thread for pair in done]
    assert len(served) == THREADS * 300
    wrong = sum(not torch.equal(rows, weights[1][ids]) for ids, rows in served)
    assert wrong == 0, f"{wrong} of {len(served)} lookups wrong"
    assert cache.stats.hits > 0
    engine.close()
    store.close()


# ---------------------------------------------------------------------- stores
STORES = {
    "host-pageable": dict(tier="host", host_alloc="pageable"),
    "disk": dict(tier="disk"),
    "disk-dram_cache": dict(tier="disk", dram_cache=True),
    "disk-direct_io": dict(tier="disk", direct_io=True),
    "disk-direct_io-dram_cache": dict(tier="disk", direct_io=True, dram_cache=True),
}


def _store(table, options: dict):
    path, hasher, _, direct_ok = table
    _skip_unsupported(options, direct_ok)
    options = dict(options)
    dram_cache = options.pop("dram_cache", False)
    store = place_layer(EngramTableFile(path, layout=hasher.layout).layer(1), progress=False, **options)
    return store.with_dram_cache(CACHE_ROWS * ROW_BYTES) if dram_cache else store


def _check_store(store, raw: torch.Tensor, calls: int) -> tuple[int, int]:
    """THREADS threads x `calls` `gather_raw` calls of 16 ids (repeats included): (calls whose rows
    differ from the table's, calls that raised)."""
    work = [
        [
            torch.randint(0, raw.shape[0], (16,), generator=torch.Generator().manual_seed(1000 * t + i))
            for i in range(calls)
        ]
        for t in range(THREADS)
    ]
    results, errors = _hammer(work, lambda t, ids: store.gather_raw(ids))
    wrong = sum(
        got is not None and not torch.equal(got, raw[ids])
        for t in range(THREADS)
        for ids, got in zip(work[t], results[t])
    )
    return wrong, len(errors)


@pytest.mark.parametrize("kind", list(STORES))
def test_threads_sharing_a_store_get_their_own_rows(table, kind):
    store = _store(table, STORES[kind])
    try:
        wrong, failed = _check_store(store, table[2][1].view(torch.uint8), 200)
    finally:
        store.close()
    assert (wrong, failed) == (0, 0), f"{wrong} reads of {THREADS * 200} wrong, {failed} raised"


def test_negative_control_a_dram_cached_store_without_the_cache_lock_serves_other_rows(table):
    store = _store(table, STORES["disk-dram_cache"])
    try:
        store.cache.lock = _NoLock()
        # a race: on a loaded machine threads interleave coarsely, so one try of 8 x 400 calls can miss it
        for _ in range(5):
            wrong, failed = _check_store(store, table[2][1].view(torch.uint8), 400)
            if wrong:
                break
    finally:
        store.close()
    assert wrong > 0, f"no wrong rows without the cache's lock in 5 tries ({failed} reads raised)"


# ---------------------------------------------------------------------- RowCache
def _id_rows(ids: torch.Tensor) -> torch.Tensor:
    """Raw rows whose bytes derive from their id, so a row read from another id's slot shows."""
    return ((ids[:, None] * 131 + torch.arange(ROW_BYTES)) % 251).to(torch.uint8)


def _check_cache(cache: RowCache, calls: int) -> tuple[int, int]:
    """THREADS threads x `calls` rounds of probe -> read of the hits (under ``cache.lock``) -> admission
    of the misses: (rounds that read a row not its id's, rounds that raised)."""
    work = [
        [
            torch.unique(torch.randint(0, 400, (24,), generator=torch.Generator().manual_seed(1000 * t + i)))
            for i in range(calls)
        ]
        for t in range(THREADS)
    ]

    def step(t: int, ids: torch.Tensor) -> bool:
        with cache.lock:
            slot = cache.probe(ids)
            hit = slot >= 0
            rows = cache.read(slot[hit])
        cache.admit(ids[~hit], _id_rows(ids[~hit]))
        return torch.equal(rows, _id_rows(ids[hit]))

    results, errors = _hammer(work, step)
    return sum(ok is False for per_thread in results for ok in per_thread), len(errors)


def test_threads_sharing_a_row_cache_read_the_rows_of_their_ids():
    cache = RowCache(CACHE_ROWS, ROW_BYTES, ways=16)
    wrong, failed = _check_cache(cache, 300)
    assert (wrong, failed) == (0, 0), f"{wrong} rounds of {THREADS * 300} read wrong rows, {failed} raised"
    assert 0 < cache.stats.hits < cache.stats.lookups
    keys = cache.keys.flatten()
    live = keys[keys >= 0]
    assert live.unique().numel() == live.numel(), "an id admitted twice"
    assert torch.equal(cache.data[torch.nonzero(keys >= 0).flatten()], _id_rows(live))


def test_negative_control_a_row_cache_without_its_lock_returns_other_ids_rows():
    cache = RowCache(CACHE_ROWS, ROW_BYTES, ways=16)
    cache.lock = _NoLock()
    wrong, failed = _check_cache(cache, 300)
    assert wrong > 0, f"no wrong rows without the cache's lock ({failed} rounds raised)"
