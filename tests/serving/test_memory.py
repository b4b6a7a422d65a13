"""EngramMemory: prefetched rows give exactly the module's own result; decode history equals full hashing."""

from __future__ import annotations

import pytest
import torch

from condmem import Engram, EngramConfig, EngramLayout, NgramHasher
from condmem.serving import EngramMemory, EngramMemoryError
from helpers import devices


def _setup(device="cpu"):
    cfg = EngramConfig(
        layer_ids=[1, 3],
        max_ngram_size=3,
        n_heads=2,
        head_dim=16,
        table_size=101,
        hidden_size=32,
        hc_mult=1,
        compressed_vocab_size=70,
    )
    hasher = NgramHasher(EngramLayout(cfg))
    torch.manual_seed(0)
    modules = {
        lid: Engram(cfg, hasher.layout.layer(lid).num_embeddings, layer_id=lid, dtype=torch.bfloat16).to(device)
        for lid in cfg.layer_ids
    }
    return cfg, hasher, modules


def _host_memory(hasher, modules, device, **kwargs) -> EngramMemory:
    """Host-tier memory over the modules' tables (pageable on CPU, registered mappings on CUDA)."""
    weights = {lid: m.table.weight for lid, m in modules.items()}
    host_alloc = "pageable" if device == "cpu" else "mmap_register"
    return EngramMemory.from_weights(hasher, weights, "host", device, host_alloc=host_alloc, **kwargs)


@pytest.mark.parametrize(
    ("device", "tier"),
    [
        ("cpu", "host"),
        pytest.param("cuda", "host", marks=pytest.mark.gpu),
        pytest.param("cuda", "hbm", marks=pytest.mark.gpu),
    ],
)
@pytest.mark.parametrize("cache", [0, 4096], ids=["nocache", "cache"])
def test_prefetched_rows_equal_the_module_table(device, tier, cache):
    cfg, hasher, modules = _setup(device)
    memory = EngramMemory.from_weights(
        hasher,
        {lid: m.table.weight for lid, m in modules.items()},
        tier,
        device,
        host_alloc="pageable" if device == "cpu" else "mmap_register",
        cache_bytes=cache,
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 70, (3, 11), generator=gen).to(device)
        prepared = memory.prepare(ids)
        h = torch.randn(3, 11, 32, generator=gen).to(device, torch.bfloat16)
        for lid, module in modules.items():
            expect = module(h, hasher(ids)[:, :, hasher.layer_index(lid)])
            got = module(h, prepared.row_ids(lid), rows=prepared.rows(lid))
            assert torch.equal(got, expect)
    memory.close()


@pytest.mark.parametrize("device", devices())
def test_decode_history_equals_hashing_whole_sequences(device):
    cfg, hasher, modules = _setup(device)
    memory = _host_memory(hasher, modules, device, max_sequences=4)
    gen = torch.Generator().manual_seed(2)
    # Three requests with different prompt lengths; one leaves early and a new one reuses its slot.
    seqs = {name: torch.randint(0, 70, (n,), generator=gen).tolist() for name, n in (("a", 5), ("b", 2), ("c", 7))}
    live = {}
    for name in ("a", "b"):
        slot = memory.allocate()
        memory.prepare(torch.tensor([seqs[name]], device=device), slots=torch.tensor([slot]))
        live[name] = slot
    for step in range(8):
        if step == 3:  # b leaves, c joins in its slot
            memory.free(live.pop("b"))
            slot = memory.allocate()
            memory.prepare(torch.tensor([seqs["c"]], device=device), slots=torch.tensor([slot]))
            live["c"] = slot
        names = sorted(live)
        new = torch.randint(0, 70, (len(names),), generator=gen)
        # A padding row that names a live slot must change nothing.
        slots = torch.tensor([live[n] for n in names] + [live[names[0]]])
        ids = torch.cat([new, torch.tensor([0])])
        valid = torch.tensor([True] * len(names) + [False])
        prepared = memory.prepare_decode(slots, ids, valid=valid)
        for i, name in enumerate(names):
            seqs[name].append(int(new[i]))
            full = hasher(torch.tensor([seqs[name]], device=device))[0, -1]  # [L, C]
            assert torch.equal(prepared.row_ids_all[i, 0], full)
            for lid in cfg.layer_ids:
                rows = prepared.rows(lid)[i, 0]
                assert torch.equal(rows, modules[lid].table.weight[full[hasher.layer_index(lid)]].to(rows.device))
    memory.close()


def test_memory_refuses_mismatched_tables():
    cfg, hasher, modules = _setup()
    weights = {lid: m.table.weight for lid, m in modules.items()}
    with pytest.raises(EngramMemoryError, match=r"no table for Engram layer\(s\) \[3\]"):
        EngramMemory.from_weights(hasher, {1: weights[1]}, "host", host_alloc="pageable")
    with pytest.raises(EngramMemoryError, match="rows"):
        EngramMemory.from_weights(hasher, {1: weights[1], 3: weights[1][:50]}, "host", host_alloc="pageable")


@pytest.mark.parametrize("device", devices())
def test_prepare_refuses_ids_outside_the_vocabulary(device):
    """Host ids are range-checked on the host (before any device work); device ids on the device,
    raised at the latest where the caller waits for rows."""
    from condmem.hashing.hasher import HashInputError

    cfg, hasher, modules = _setup(device)
    memory = _host_memory(hasher, modules, device)
    bad = torch.tensor([[1, 2, 70]])
    with pytest.raises(HashInputError, match="token id 70 is outside"):
        memory.prepare(bad)
    with pytest.raises(HashInputError, match="token id 70 is outside"):
        prepared = memory.prepare(bad.to(device))
        prepared.rows(cfg.layer_ids[0])
        hasher.raise_pending()
    memory.close()


@pytest.mark.gpu
def test_negative_control_rows_read_without_waiting_are_wrong():
    """Removing the wait on the lookup's event must break exactness, or the test above proves nothing."""
    cfg, hasher, modules = _setup("cuda")
    memory = EngramMemory.from_weights(
        hasher, {lid: m.table.weight for lid, m in modules.items()}, "host", "cuda", cpu_fraction=1.0
    )
    ids = torch.randint(0, 70, (4, 64), device="cuda")
    engine = memory.engines[1]
    engine.direct_max_ids = 0  # the full path: CPU gather -> staging -> DMA
    with torch.cuda.stream(engine.copy_stream):
        torch.cuda._sleep(200_000_000)  # hold the DMAs back ~0.1 s
    prepared = memory.prepare(ids)
    early = prepared.rows(1, wait=False).clone()  # no wait: reads the buffer before it is filled
    late = prepared.rows(1)
    expect = modules[1].table.weight[hasher(ids)[:, :, 0]]
    assert torch.equal(late, expect)
    assert not torch.equal(early, expect)
    memory.close()


@pytest.mark.parametrize("device", devices())
def test_calibration_on_token_batches_keeps_rows_exact(device):
    """EngramMemory.calibrate hashes the caller's batches and times each host layer's split on
    them (on the CPU the split is unused and kept); rows stay exact afterwards."""
    cfg, hasher, modules = _setup(device)
    memory = _host_memory(hasher, modules, device, cache_bytes=4096, cpu_fraction=0.5)
    gen = torch.Generator().manual_seed(2)
    sample = [torch.randint(0, 70, (4, 64), generator=gen) for _ in range(4)]
    with pytest.raises(EngramMemoryError, match="at least two"):
        memory.calibrate(sample[:1])
    chosen = memory.calibrate(sample, candidates=(0.0, 0.5, 1.0))
    assert set(chosen) == set(cfg.layer_ids) and all(f in (0.0, 0.5, 1.0) for f in chosen.values())
    from condmem.hashing.hasher import HashInputError

    with pytest.raises(HashInputError, match="outside"):
        memory.calibrate([torch.tensor([[1, 2, 70]])] * 2)
    ids = torch.randint(0, 70, (2, 9), generator=gen).to(device)
    prepared = memory.prepare(ids)
    for lid, module in modules.items():
        assert torch.equal(prepared.rows(lid), module.table.weight[hasher(ids)[:, :, hasher.layer_ids.index(lid)]])
    memory.close()


@pytest.mark.parametrize("device", devices())
def test_ragged_batches_serve_the_rows_of_whole_sequences(device):
    """Chunked prefill, a prefix-cache hit, decode tokens and speculative drafts through
    EngramMemory: every committed token's rows equal the module table at its whole-sequence ids."""
    cfg, hasher, modules = _setup(device)
    weights = {lid: m.table.weight for lid, m in modules.items()}
    memory = EngramMemory.from_weights(
        hasher, weights, "host", device, host_alloc="pageable" if device == "cpu" else "mmap_register", max_sequences=4
    )
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randint(0, 70, (9,), generator=gen), torch.randint(0, 70, (6,), generator=gen)
    truth = {name: hasher(seq[None].to(device))[0] for name, seq in (("a", a), ("b", b))}
    sa, sb = memory.allocate(), memory.allocate()
    memory.seed(torch.tensor([sb]), torch.tensor([[int(b[1]), int(b[2])]]))  # b's first 3 tokens are cached

    def check(prepared, pieces):
        at = 0
        for name, lo, hi in pieces:
            for lid, i in ((lid, hasher.layer_index(lid)) for lid in cfg.layer_ids):
                got_ids = prepared.row_ids(lid)[0, at : at + hi - lo]
                assert torch.equal(got_ids, truth[name][lo:hi, i])
                got_rows = prepared.rows(lid)[0, at : at + hi - lo]
                assert torch.equal(got_rows, weights[lid][truth[name][lo:hi, i]].to(got_rows.dtype))
            at += hi - lo

    # step 1: a's first chunk (4 tokens) + b's first uncached chunk (2 tokens) + 2 padding tokens
    ids = torch.cat([a[:4], b[3:5], torch.tensor([7, 7])])
    check(memory.prepare_ragged(ids, torch.tensor([0, 4, 6]), slots=torch.tensor([sa, sb])), [("a", 0, 4), ("b", 3, 5)])
    # step 2: a's rest of the prompt + b's last token (decode)
    check(
        memory.prepare_ragged(torch.cat([a[4:7], b[5:6]]), torch.tensor([0, 3, 4]), slots=torch.tensor([sa, sb])),
        [("a", 4, 7), ("b", 5, 6)],
    )
    memory.free(sb)
    # step 3: speculative verify for a: [a7, a8, wrong draft]; 2 accepted
    ids = torch.cat([a[7:9], torch.tensor([(int(a[8]) + 1) % 70])])
    cu = torch.tensor([0, 3])
    check(memory.prepare_ragged(ids, cu, slots=torch.tensor([sa]), commit=False), [("a", 7, 9)])
    memory.commit(torch.tensor([sa]), ids, cu, torch.tensor([2]))
    nxt = torch.tensor([5])
    rows = memory.prepare_ragged(nxt, torch.tensor([0, 1]), slots=torch.tensor([sa])).row_ids(cfg.layer_ids[0])
    full = hasher(torch.cat([a, nxt])[None].to(device))[0, -1:, hasher.layer_index(cfg.layer_ids[0])]
    assert torch.equal(rows[0], full)
    memory.close()


@pytest.mark.parametrize("device", devices())
def test_warm_up_captures_every_layer_and_rows_stay_exact(device):
    """EngramMemory.warm_up(batch_tokens): each layer's plans for those batch sizes are captured
    (CUDA; a no-op on the CPU), and lookups of warmed and other sizes give the module's rows."""
    cfg, hasher, modules = _setup(device)
    memory = _host_memory(hasher, modules, device, cache_bytes=4096)
    for engine in memory.engines.values():
        engine.direct_max_ids = 0  # the full path, which has plans to capture
    memory.warm_up([4 * 64])
    for engine in memory.engines.values():
        captured = [p.captured for ring in engine._plans.values() for p in ring]
        assert captured == ([True] * engine.max_in_flight if device == "cuda" else [])
    gen = torch.Generator().manual_seed(5)
    for shape in ((4, 64), (2, 64), (4, 64), (3, 7)):
        ids = torch.randint(0, 70, shape, generator=gen).to(device)
        prepared = memory.prepare(ids)
        for lid, module in modules.items():
            assert torch.equal(prepared.rows(lid), module.table.weight[hasher(ids)[:, :, hasher.layer_index(lid)]])
    memory.close()


@pytest.mark.parametrize("device", devices())
def test_fetch_timing_says_how_much_of_the_fetch_was_hidden(device):
    """`measure_fetch`: per batch and layer, the compute the fetch had in front of it (lead) and
    the layer's wait (stall). On the CPU the lookups run inside `prepare`: nothing hidden. On a
    GPU, compute queued before the rows are read hides the fetch (hidden ~1); a fetch held back
    on its copy stream and read at once is not hidden (negative control)."""
    from condmem.serving.memory import FetchTiming

    cfg, hasher, modules = _setup(device)
    memory = _host_memory(hasher, modules, device, cpu_fraction=1.0, measure_fetch=True)
    for engine in memory.engines.values():
        engine.direct_max_ids = 0  # CPU gather -> staging -> DMA
    ids = torch.randint(0, 70, (4, 64), generator=torch.Generator().manual_seed(6)).to(device)
    if device == "cpu":
        prepared = memory.prepare(ids)
        prepared.rows(1)
        (timing,) = prepared.fetch_timing().values()
        assert timing.lead_ms == 0.0 and timing.hidden == 0.0
    else:
        # One untimed batch first: the first fetch of a process also sets up its threads and
        # staging buffers, one-time work that is not the steady-state fetch timed here (a first
        # fetch beside busy workers once stalled 0.9 s after a 0.7 s lead).
        memory.prepare(ids).rows(1)
        torch.cuda.synchronize()
        prepared = memory.prepare(ids)
        # ~0.5 s of "layers" before the Engram layer: far beyond the fetch's own time, also with
        # busy parallel test workers slowing its host gather
        torch.cuda._sleep(1_000_000_000)
        prepared.rows(1)
        hidden = prepared.fetch_timing()[1]
        assert hidden.hidden > 0.98 and hidden.lead_ms > 100
        engine = memory.engines[3]
        with torch.cuda.stream(engine.copy_stream):
            # hold this layer's DMA back ~0.5 s: far beyond the host's own time to queue and read
            # the lookup, also with busy parallel test workers beside it
            torch.cuda._sleep(1_000_000_000)
        late = memory.prepare(ids)
        late.rows(3)
        exposed = late.fetch_timing()[3]
        assert exposed.stall_ms > 10 and exposed.hidden < 0.5
    assert FetchTiming(3.0, 1.0).hidden == 0.75 and FetchTiming(3.0, 0.0).hidden == 1.0
    plain = _host_memory(hasher, modules, device)
    with pytest.raises(EngramMemoryError, match="measure_fetch"):
        plain.prepare(ids).fetch_timing()
    plain.close()
    memory.close()


@pytest.mark.parametrize("device", devices())
def test_fresh_prompts_hashed_without_slots_then_committed_equal_prepared_with_slots(device):
    """A scheduler may fetch a queued prompt batch before its sequences have slots
    (`prepare_ragged(..., slots=None)`) and commit their histories when they are admitted
    (`commit` of whole prompts): row ids, rows and the histories left for decode equal a
    prepare with fresh slots."""
    cfg, hasher, modules = _setup(device)
    weights = {lid: m.table.weight for lid, m in modules.items()}
    kw = dict(host_alloc="pageable" if device == "cpu" else "mmap_register", max_sequences=6)
    early, plain = (EngramMemory.from_weights(hasher, weights, "host", device, **kw) for _ in range(2))
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 70, (n,), generator=gen) for n in (1, 2, 7, 4)]
    ids = torch.cat(prompts)
    cu = torch.tensor([0, *torch.tensor([p.numel() for p in prompts]).cumsum(0).tolist()])
    for memory in (early, plain):  # a used slot first: admission must reset it
        s = memory.allocate()
        memory.prepare_ragged(torch.tensor([3, 4, 5]), torch.tensor([0, 3]), slots=torch.tensor([s]))
        memory.free(s)
    fetched = early.prepare_ragged(ids, cu, slots=None)
    slots = torch.tensor([early.allocate() for _ in prompts])
    early.commit(slots, ids, cu, cu[1:] - cu[:-1])
    plain_slots = torch.tensor([plain.allocate() for _ in prompts])
    want = plain.prepare_ragged(ids, cu, slots=plain_slots)
    for lid in cfg.layer_ids:
        assert torch.equal(fetched.row_ids(lid), want.row_ids(lid))
        assert torch.equal(fetched.rows(lid), want.rows(lid))
    nxt = torch.randint(0, 70, (len(prompts),), generator=gen)
    a = early.prepare_decode(slots, nxt)
    b = plain.prepare_decode(plain_slots, nxt)
    for lid in cfg.layer_ids:
        assert torch.equal(a.row_ids(lid), b.row_ids(lid))
        whole = torch.stack(
            [
                hasher(torch.cat([p, n[None]])[None].to(device))[0, -1, hasher.layer_index(lid)]
                for p, n in zip(prompts, nxt)
            ]
        )
        assert torch.equal(a.row_ids(lid)[:, 0], whole)
    early.close(), plain.close()


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["host", "hbm"])
@pytest.mark.parametrize("tokens", [12, 6000], ids=["direct", "planned"])
def test_gpu_prompt_batch_given_on_the_host_starts_without_a_host_sync(tier, tokens):
    """Ids, boundaries and slots given on the host are hashed and their lookups started with no
    host sync (`torch.cuda.set_sync_debug_mode("error")` raises on one): a blocking copy would
    hold the host until the GPU had finished the work queued before it, e.g. the previous
    prompt batch's forward, and the next batch would start on an idle GPU. The rows stay exact."""
    cfg, hasher, modules = _setup("cuda")
    weights = {lid: m.table.weight for lid, m in modules.items()}
    memory = EngramMemory.from_weights(hasher, weights, tier, "cuda", max_sequences=4, cpu_fraction=1.0)
    slots = torch.tensor([memory.allocate(), memory.allocate()])
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 70, (tokens,), generator=gen)
    cu = torch.tensor([0, tokens // 3, tokens])
    memory.prepare_ragged(ids, cu, slots=slots, commit=False).rows(cfg.layer_ids[0])  # compiles, plans
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        prepared = memory.prepare_ragged(ids, cu, slots=slots, commit=False)
        rows = {lid: prepared.rows(lid) for lid in cfg.layer_ids}
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for lid in cfg.layer_ids:
        want = weights[lid][prepared.row_ids(lid)].to(rows[lid].dtype)
        assert torch.equal(rows[lid], want)
    memory.close()
