"""Serving over the paged KV cache: packed prefill, decode through the block table, joined projections.

CPU runs the fp32 references of the attention ops; the same code runs the Triton kernels on a
GPU (`tests/kernels/test_kernels_attention.py` holds those to the references).
"""

from __future__ import annotations

import torch

from condmem.models.config import ModelConfig
from condmem.models.transformer import DecoderLM
from condmem.serving import ServingCache, decode_step, packed_ids, prefill, prefill_packed
from condmem.models.layers import joined_weight
from tests.helpers import assert_close

VOCAB = 61


def _model(seed: int = 0) -> DecoderLM:
    cfg = ModelConfig(vocab_size=VOCAB, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=48)
    model = DecoderLM(cfg, seed=seed).eval()
    with torch.no_grad():  # sharper attention, so a wrong key or position shows
        for block in model.blocks:
            block.attn.wq.weight.mul_(6.0)
            block.attn.wk.weight.mul_(6.0)
    return model


def _prompts():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in (7, 1, 12, 4)]


@torch.no_grad()
def test_packed_prefill_then_decode_equals_full_forward():
    """Packed prompts (no padding), then decode steps: each step's logits equal a full forward over
    the sequence so far, and the greedy tokens are the full forward's."""
    model, prompts = _model(), _prompts()
    cache = ServingCache(model, n_slots=4, max_len=24, block_size=4)
    slots = [2, 0, 3, 1]
    logits = prefill_packed(model, cache, slots, prompts)
    seqs = [p.tolist() for p in prompts]
    for step in range(5):
        for b, seq in enumerate(seqs):
            full = model(torch.tensor([seq]))[0, -1]
            assert_close(f"step {step} sequence {b}", full, logits[b], atol=2e-5, rtol=2e-5)
        nxt = logits.argmax(-1)
        for b, seq in enumerate(seqs):
            seq.append(int(nxt[b]))
        logits = decode_step(model, cache, torch.tensor(slots), nxt)
    assert cache.host_lengths == [len(seqs[1]), len(seqs[3]), len(seqs[0]), len(seqs[2])]


@torch.no_grad()
def test_a_shuffled_block_table_gives_the_same_logits():
    """The cache is read and written through the block table: any assignment of blocks to slots
    gives the same results as blocks in order."""
    model, prompts = _model(), _prompts()
    ordered = ServingCache(model, n_slots=4, max_len=24, block_size=4)
    shuffled = ServingCache(model, n_slots=4, max_len=24, block_size=4)
    shuffled.block_table.copy_(
        shuffled.block_table.flatten()[
            torch.randperm(shuffled.block_table.numel(), generator=torch.Generator().manual_seed(3))
        ].view_as(shuffled.block_table)
    )
    a = prefill_packed(model, ordered, [0, 1, 2, 3], prompts)
    b = prefill_packed(model, shuffled, [0, 1, 2, 3], prompts)
    assert torch.equal(a, b)
    for _ in range(3):
        nxt = a.argmax(-1)
        a = decode_step(model, ordered, torch.tensor([0, 1, 2, 3]), nxt)
        b = decode_step(model, shuffled, torch.tensor([0, 1, 2, 3]), nxt)
        assert torch.equal(a, b)


@torch.no_grad()
def test_packed_prefill_equals_one_prompt_at_a_time_and_fills_the_same_positions():
    model, prompts = _model(), _prompts()
    packed, single = ServingCache(model, n_slots=4, max_len=24), ServingCache(model, n_slots=4, max_len=24)
    got = prefill_packed(model, packed, [0, 1, 2, 3], prompts)
    want = torch.stack([prefill(model, single, s, p, last_only=True)[0] for s, p in enumerate(prompts)])
    assert_close("last-token logits", want, got, atol=2e-5, rtol=2e-5)
    for i in range(len(model.blocks)):  # the same keys and values at positions 0..n-1 of each slot
        for s, p in enumerate(prompts):
            for name, a, b in zip("kv", single.prefix(i, s, p.numel()), packed.prefix(i, s, p.numel())):
                assert_close(f"layer {i} slot {s} {name}", a, b, atol=2e-5)
    ids, cu = packed_ids(prompts)
    assert ids.shape == (24,) and cu.tolist() == [0, 7, 8, 20, 24]


@torch.no_grad()
def test_idle_graph_rows_change_nothing():
    """`decode_step(slots=None, valid=...)`: rows marked invalid write no key, value, length or token."""
    model, prompts = _model(), _prompts()
    cache = ServingCache(model, n_slots=4, max_len=24, block_size=4)
    prefill_packed(model, cache, [0, 1, 2, 3], prompts)
    before = (
        [p.clone() for p in cache.k_pool],
        [p.clone() for p in cache.v_pool],
        cache.lengths.clone(),
        cache.tokens.clone(),
    )
    valid = torch.tensor([True, False, True, False])
    decode_step(model, cache, None, torch.tensor([5, 6, 7, 8]), check=False, valid=valid)
    table = cache.block_table
    for i in range(len(model.blocks)):
        for pool, old in ((cache.k_pool[i], before[0][i]), (cache.v_pool[i], before[1][i])):
            for slot in (1, 3):
                assert torch.equal(pool[table[slot].long()], old[table[slot].long()])
            assert not torch.equal(pool[table[0].long()], old[table[0].long()])
    assert cache.lengths.tolist() == [8, 1, 13, 4] and torch.equal(cache.tokens[[1, 3]], before[3][[1, 3]])


def test_joined_projections_are_views_and_follow_a_move():
    model = _model()
    attn = model.blocks[0].attn
    ids = torch.randint(0, VOCAB, (1, 6))
    before = model(ids)
    joined = joined_weight(attn, (attn.wq, attn.wk, attn.wv))
    assert attn.wk.weight.data_ptr() == joined[attn.wq.weight.shape[0] :].data_ptr()
    assert joined_weight(attn, (attn.wq, attn.wk, attn.wv)) is joined
    assert torch.equal(before, model(ids)), "joining must not change the model"
    model.double()
    again = joined_weight(attn, (attn.wq, attn.wk, attn.wv))
    assert again.dtype == torch.float64 and again.data_ptr() == attn.wq.weight.data_ptr()


def test_prefix_store_read_and_copy_go_through_a_shuffled_block_table():
    """`store_prefix` / `prefix` / `copy_prefix` address blocks through the table: with the
    table shuffled, a stored prefix reads back bit-equal, lands where the attention reads it
    (the reference gather over the table) and a copied prefix equals its source; the other
    slots' blocks stay as they were."""
    from condmem.ops.attention.reference import gather_paged

    model = _model()
    cache = ServingCache(model, n_slots=3, max_len=24, block_size=4)
    cache.block_table.copy_(
        cache.block_table.flatten()[
            torch.randperm(cache.block_table.numel(), generator=torch.Generator().manual_seed(5))
        ].view_as(cache.block_table)
    )
    gen = torch.Generator().manual_seed(6)
    n_kv, hd = cache.k_pool[0].shape[2:]
    k = torch.randn(2, n_kv, 10, hd, generator=gen)
    v = torch.randn(2, n_kv, 10, hd, generator=gen)
    cache.store_prefix(0, torch.tensor([2, 0]), k, v)
    for row, slot in enumerate((2, 0)):
        got_k, got_v = cache.prefix(0, slot, 10)
        assert torch.equal(got_k, k[row]) and torch.equal(got_v, v[row])
        dense_k = gather_paged(cache.k_pool[0], cache.block_table[slot : slot + 1], 10)[0]  # [10, n_kv, hd]
        assert torch.equal(dense_k.transpose(0, 1), k[row])
    assert not cache.k_pool[0][cache.block_table[1].long()].any(), "slot 1 was written"
    assert not cache.k_pool[1].any(), "layer 1 was written"
    cache.tokens[2, :10] = torch.arange(10)
    cache.copy_prefix(2, 1, 7)
    got_k, got_v = cache.prefix(0, 1, 7)
    assert torch.equal(got_k, k[0, :, :7]) and torch.equal(got_v, v[0, :, :7])
    assert torch.equal(cache.tokens[1, :7], torch.arange(7))


def test_prefix_helpers_refuse_bad_slots_positions_and_shapes():
    import pytest

    model = _model()
    cache = ServingCache(model, n_slots=2, max_len=24, block_size=4)
    k = torch.zeros(1, 2, 5, 12)
    with pytest.raises(ValueError, match="outside the cache"):
        cache.store_prefix(0, torch.tensor([2]), k, k)
    with pytest.raises(ValueError, match="must both be"):
        cache.store_prefix(0, torch.tensor([0]), k, torch.zeros(1, 2, 6, 12))
    with pytest.raises(ValueError, match="positions"):
        cache.copy_prefix(0, 1, 25)
    with pytest.raises(ValueError, match="outside the cache"):
        cache.copy_prefix(0, -1, 4)
    for run in (
        lambda: prefill(model, cache, -1, torch.tensor([1, 2])),
        lambda: prefill_packed(model, cache, [2], [torch.tensor([1, 2])]),
    ):
        with pytest.raises(ValueError, match="slot -1 outside|slot 2 outside"):
            run()
