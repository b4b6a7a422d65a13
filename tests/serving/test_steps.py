"""Continuous batching: sequences join and leave between decode steps, each at its own position.

Each step's logits match a full forward over the sequence so far (fp32 tolerance: the
kernels differ), and the same schedule served from EngramMemory (host tier, prefetched
rows) is torch.equal to serving from the model's own tables.
"""

from __future__ import annotations

import pytest
import torch

from condmem.serving import EngramMemory, ServingCache, decode_step, prefill
from helpers import assert_close, devices
from model_fixtures import tiny_engram_lm as _model


def _schedule(model, device, memory=None, steps=14, leave_b=3, join_c=3, join_d=7, leave_a=9):
    """Run a join/leave schedule; returns [(slot -> logits)] per step and the sequences."""
    gen = torch.Generator().manual_seed(5)
    prompts = {name: torch.randint(0, 50, (n,), generator=gen) for name, n in (("a", 5), ("b", 9), ("c", 3), ("d", 1))}
    cache = ServingCache(model, n_slots=3, max_len=16 + steps)
    free = [0, 1, 2]
    live, seqs, history = {}, {}, []

    def join(name):
        slot = memory.allocate() if memory is not None else free.pop(0)
        ids = prompts[name].to(device)
        prepared = memory.prepare(ids[None], slots=torch.tensor([slot])) if memory is not None else None
        logits = prefill(model, cache, slot, ids, prepared=prepared)
        live[name], seqs[name] = slot, prompts[name].tolist()
        return logits[-1]

    def leave(name):
        slot = live.pop(name)
        cache.release(slot)
        memory.free(slot) if memory is not None else free.append(slot)

    last = {n: join(n) for n in ("a", "b")}
    for step in range(steps):
        if step == leave_b:
            leave("b")
        if step == join_c:
            last["c"] = join("c")
        if step == join_d:
            last["d"] = join("d")
        if step == leave_a:
            leave("a")
        names = sorted(live)
        nxt = torch.stack([last[n].argmax() for n in names])
        slots = torch.tensor([live[n] for n in names])
        prepared = memory.prepare_decode(slots, nxt) if memory is not None else None
        logits = decode_step(model, cache, slots, nxt, prepared=prepared)
        step_out = {}
        for i, n in enumerate(names):
            seqs[n].append(int(nxt[i]))
            last[n] = logits[i]
            step_out[n] = (logits[i], list(seqs[n]))
        history.append(step_out)
    return history


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("device", devices())
def test_joins_and_leaves_match_full_forward(device, moe):
    """With routed experts too: the serving steps run them through the one block forward."""
    model, _ = _model(device, moe=moe)
    with torch.no_grad():
        # Sharpen attention (a fresh init attends almost uniformly, which would hide position errors).
        for block in model.blocks:
            block.attn.wq.weight.mul_(8.0)
            block.attn.wk.weight.mul_(8.0)
        for step in _schedule(model, device):
            for name, (logits, seq) in step.items():
                full = model(torch.tensor([seq], device=device))[0, -1]
                assert_close(f"step logits of {name}", full, logits, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("device", devices())
def test_serving_from_prefetched_host_tables_is_exact(device):
    model, tables = _model(device)
    memory = EngramMemory.from_weights(
        model.hasher,
        tables,
        "host",
        device,
        max_sequences=3,
        host_alloc="pageable" if device == "cpu" else "mmap_register",
    )
    # 64 decode steps; sequences join and leave along the way.
    schedule = dict(steps=64, leave_b=10, join_c=10, join_d=30, leave_a=45)
    plain = _schedule(model, device, **schedule)
    served = _schedule(model, device, memory=memory, **schedule)
    assert len(served) == 64
    for a, b in zip(plain, served):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name][0], b[name][0]), name
    memory.close()


def test_all_slots_step_with_valid_mask_matches_and_leaves_invalid_rows_untouched():
    """`decode_step(slots=None, valid=...)` (the CUDA-graph form) equals stepping the valid slots only,
    and leaves every piece of an invalid slot's state (KV, tokens, length, ShortConv) as it was."""
    model, _ = _model("cpu")
    gen = torch.Generator().manual_seed(11)
    caches = [ServingCache(model, n_slots=3, max_len=32) for _ in range(2)]
    for cache in caches:
        for slot, n in enumerate((4, 7, 2)):
            prefill(model, cache, slot, torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(slot)))
    ids = torch.randint(0, 50, (3,), generator=gen)

    def slot_state(cache, slot):
        kv = [t for i in range(len(model.blocks)) for t in cache.prefix(i, slot, cache.max_len)]
        return [
            t.clone()
            for t in (
                *kv,
                cache.tokens[slot],
                cache.lengths[slot],
                *[c[slot] for c in cache.conv.values() if c is not None],
            )
        ]

    before = slot_state(caches[1], 1)
    by_slots = decode_step(model, caches[0], torch.tensor([0, 2]), ids[[0, 2]])
    all_rows = decode_step(model, caches[1], None, ids, valid=torch.tensor([True, False, True]))
    assert_close("valid rows", by_slots, all_rows[[0, 2]], atol=1e-5, rtol=1e-5)
    for old, new in zip(before, slot_state(caches[1], 1), strict=True):
        assert torch.equal(old, new), "the invalid slot's state changed"
    assert caches[1].lengths.tolist() == [5, 7, 3]
    assert caches[0].host_lengths == [5, 7, 3]


@pytest.mark.parametrize("device", devices())
def test_batched_prefill_equals_one_prompt_at_a_time(device):
    """Right-padded group prefill: same last-token logits and the same decode afterwards; from
    prefetched host rows it is torch.equal to the model's own tables."""
    from condmem.serving import padded_ids, prefill_batch

    model, tables = _model(device, short_conv=False)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 50, (n,), generator=gen).to(device) for n in (7, 2, 11)]
    one, grouped, served = (ServingCache(model, n_slots=3, max_len=32) for _ in range(3))
    first = torch.stack([prefill(model, one, s, p, last_only=True)[0] for s, p in enumerate(prompts)])
    batched = prefill_batch(model, grouped, [0, 1, 2], prompts)
    assert_close("prefill", first, batched, atol=1e-4, rtol=1e-4)
    memory = EngramMemory.from_weights(model.hasher, tables, "host", device, max_sequences=3)
    slots = [memory.allocate() for _ in prompts]
    ids, lengths = padded_ids([p.cpu() for p in prompts])
    from_memory = prefill_batch(
        model, served, slots, prompts, prepared=memory.prepare(ids, slots=torch.tensor(slots), lengths=lengths)
    )
    assert torch.equal(batched, from_memory)
    assert grouped.host_lengths == [7, 2, 11] and grouped.lengths.tolist() == [7, 2, 11]
    rounded = ServingCache(model, n_slots=3, max_len=32)
    assert_close("pad_to=8", batched, prefill_batch(model, rounded, [0, 1, 2], prompts, pad_to=8), atol=1e-4, rtol=1e-4)
    assert padded_ids([p.cpu() for p in prompts], 8)[0].shape == (3, 16)
    assert padded_ids([p.cpu() for p in prompts], 64, 20)[0].shape == (3, 20)
    nxt = batched.argmax(-1)
    a = decode_step(model, one, torch.tensor([0, 1, 2]), nxt)
    b = decode_step(model, grouped, torch.tensor([0, 1, 2]), nxt)
    c = decode_step(model, served, torch.tensor(slots), nxt, prepared=memory.prepare_decode(torch.tensor(slots), nxt))
    assert_close("decode after prefill", a, b, atol=1e-4, rtol=1e-4)
    assert torch.equal(b, c)
    memory.close()


def test_batched_prefill_of_a_shortconv_model_goes_one_prompt_at_a_time():
    from condmem.serving import prefill_batch

    model, _ = _model("cpu")
    prompts = [torch.randint(0, 50, (n,)) for n in (5, 3)]
    one, grouped = ServingCache(model, n_slots=2, max_len=16), ServingCache(model, n_slots=2, max_len=16)
    first = torch.stack([prefill(model, one, s, p, last_only=True)[0] for s, p in enumerate(prompts)])
    assert torch.equal(first, prefill_batch(model, grouped, [0, 1], prompts))


def test_serving_errors_name_the_problem():
    from condmem.serving import prefill_batch

    model, _ = _model("cpu", short_conv=False)
    cache = ServingCache(model, n_slots=2, max_len=8)
    prefill_batch(model, cache, [0], [torch.tensor([1, 2, 3])])
    with pytest.raises(ValueError, match="holds a live sequence"):
        prefill_batch(model, cache, [0], [torch.tensor([4])])
    with pytest.raises(ValueError, match="does not fit"):
        prefill_batch(model, cache, [1], [torch.arange(9) % 50])
    with pytest.raises(ValueError, match="2 slots for 1 prompts"):
        prefill_batch(model, cache, [0, 1], [torch.tensor([4])])
    with pytest.raises(ValueError, match="covers all 2 slots"):
        decode_step(model, cache, None, torch.tensor([1, 2, 3]), valid=torch.tensor([True, False, False]))
    for _ in range(5):
        decode_step(model, cache, torch.tensor([0]), torch.tensor([7]))
    with pytest.raises(ValueError, match="reached the cache's 8 positions"):
        decode_step(model, cache, torch.tensor([0]), torch.tensor([7]))
    with pytest.raises(ValueError, match=r"slot\(s\) \[0\] reached"):
        cache.check_room([0])
