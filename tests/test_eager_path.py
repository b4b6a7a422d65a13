"""The eager per-call path stays correct where it was made cheaper.

* id checks: a call's message is formatted only for a bad id; on a GPU the page-locked
  buffers and events are reused across calls, the hash kernels write their ranges into them
  (a checked call allocates nothing else), a bad id is still raised (once, naming it), and a
  host far ahead of its GPU keeps a bounded number of checks in flight;
* the Hugging Face adapter: inside generate() a decode step does not read a tensor on the
  host (no torch.equal, a GPU sync), and a base-model forward called with positional
  arguments finds them as with keywords.
"""

from __future__ import annotations

import inspect
import sys

import numpy as np
import pytest
import torch

from condmem import EngramConfig, EngramLayout, NgramHasher
from condmem.hashing.hasher import HashInputError
from condmem.hashing.id_checks import _MAX_PENDING, PendingIdChecks


def _hasher(device="cpu") -> NgramHasher:
    cfg = EngramConfig(
        layer_ids=[1, 2], max_ngram_size=3, n_heads=2, head_dim=8, table_size=53, compressed_vocab_size=40
    )
    hasher = NgramHasher(EngramLayout(cfg), token_lookup=np.arange(60) % 40)
    hasher.constants(device)
    return hasher


def test_a_message_is_made_only_for_a_bad_id():
    made = []

    def label():
        made.append(1)
        return "the call"

    checks = PendingIdChecks(HashInputError, bound=10, what="table", noun="row id")
    checks.submit(torch.tensor([[9, 0, 0]], dtype=torch.int32), label)
    checks.submit_ids(torch.tensor([0, 9, 3]), label)
    assert not made
    with pytest.raises(HashInputError, match=r"row id -4 is outside the table's ids 0\.\.9 \(the call\)"):
        checks.submit_ids(torch.tensor([2, -4, 3]), label)
    with pytest.raises(HashInputError, match="row id 11 is outside"):
        checks.submit_ids(torch.tensor([[11, 1]]), label)
    assert len(made) == 2


@pytest.mark.gpu
def test_gpu_checks_reuse_buffers_and_still_name_a_bad_id():
    hasher = _hasher("cuda")
    checks = hasher._checks
    ids = [torch.randint(0, 60, (2, n), device="cuda") for n in (7, 300, 5000)]
    for i in range(200):
        hasher(ids[i % 3])
        hasher.hash_ragged(ids[i % 3].reshape(-1), torch.tensor([0, ids[i % 3].numel()], device="cuda"))
    hasher.raise_pending(block=True)
    slots = sum(len(v) for v in checks._spare.values())
    assert slots < 64, f"{slots} page-locked buffers for 400 calls: they are not reused"
    bad = ids[1].clone()
    bad[1, 123] = 60 + 9
    hasher(bad)
    # Reported at the next call that finds the check done, or at the latest by raise_pending.
    with pytest.raises(HashInputError, match=f"token id {60 + 9} is outside"):
        hasher(ids[0])
        hasher.raise_pending(block=True)
    hasher.raise_pending(block=True)  # reported once
    neg = ids[0].clone()
    neg[0, 0] = -5
    with pytest.raises(HashInputError, match="token id -5 is outside"):
        hasher(neg)
        hasher.raise_pending(block=True)
    assert torch.equal(hasher(ids[2]), hasher(ids[2], backend="torch"))


@pytest.mark.gpu
def test_gpu_hash_kernels_write_their_id_ranges_into_page_locked_slots():
    """A checked call allocates its rows only (the kernel writes the ranges into a reserved page-locked
    slot: no device buffer, no copy), and an id in the last program of a large batch is still named."""
    hasher = _hasher("cuda")
    ids = torch.randint(0, 60, (3, 1000), device="cuda")  # 24 programs of 128 tokens
    cu = torch.tensor([0, 1000, 3000], device="cuda")
    hasher(ids)
    hasher.hash_ragged(ids.reshape(-1), cu)
    hasher.raise_pending(block=True)
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
    hasher(ids)
    hasher.hash_ragged(ids.reshape(-1), cu)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] - allocations == 2
    assert all(slot.host.is_pinned() for slot, *_ in hasher._checks._pending)
    hasher.raise_pending(block=True)
    for call in (lambda x: hasher(x), lambda x: hasher.hash_ragged(x.reshape(-1), cu)):
        bad = ids.clone()
        bad[2, 999] = 60 + 4
        with pytest.raises(HashInputError, match=f"token id {60 + 4} is outside"):
            call(bad)
            hasher.raise_pending(block=True)


@pytest.mark.gpu
def test_gpu_submit_ids_and_a_host_far_ahead():
    checks = PendingIdChecks(HashInputError, bound=100, what="table", noun="row id")
    checks.submit_ids(torch.tensor([5, 99, 0], device="cuda"), "good")
    checks.raise_pending(block=True)
    for bad, name in ((torch.tensor([5, -3, 7], device="cuda"), "-3"), (torch.tensor([100], device="cuda"), "100")):
        checks.submit_ids(bad, "bad")
        with pytest.raises(HashInputError, match=f"row id {name} is outside"):
            checks.raise_pending(block=True)
    # A GPU busy for a while and a host queueing checks behind it: a bounded number wait.
    torch.cuda._sleep(int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 0.2))
    good = torch.arange(50, device="cuda")
    for _ in range(_MAX_PENDING + 40):
        checks.submit_ids(good, "good")
        assert len(checks._pending) <= _MAX_PENDING
    checks.raise_pending(block=True)


# ---------------------------------------------------------------------- Hugging Face adapter
@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    from condmem.integrations.transformers import add_engram
    from condmem.tokenizer import CompressedTokenizer
    from condmem.train.bpe import train_bpe

    text = "The quick brown fox jumps over the lazy dog. def add(x, y): return x + y\n" * 6
    tok = CompressedTokenizer.from_any(train_bpe([text], vocab_size=280), use_cache=False)
    config = transformers.LlamaConfig(
        vocab_size=tok.original_vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=1,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    add_engram(
        model,
        EngramConfig(layer_ids=[1], max_ngram_size=3, n_heads=2, head_dim=8, table_size=61, pad_id=1, short_conv=False),
        tok,
        zero_init=False,
    )
    return model, tok


def test_generate_decode_steps_read_no_tensor_on_the_host(hf_model, monkeypatch):
    from condmem.integrations.transformers import adapter as adapter_module

    model, tok = hf_model
    ids = torch.randint(2, tok.original_vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    calls = []
    real_equal = torch.equal

    def counting_equal(a, b):
        if sys._getframe(1).f_code.co_filename == adapter_module.__file__:
            calls.append(1)
        return real_equal(a, b)

    monkeypatch.setattr(torch, "equal", counting_equal)
    with torch.no_grad():
        got = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert real_equal(got, want)
    assert not calls, f"the adapter compared tensors {len(calls)} times (each a GPU sync) in generate()"


def test_the_look_back_state_is_cut_only_when_a_forward_reads_it(hf_model, monkeypatch):
    """Inside generate() each step reads generate's own sequences: no step cuts the state it leaves under
    the cache. A forward continuing that cache outside generate() reads it, with the uncached rows."""
    from condmem.integrations.transformers import decode_state, get_engram

    model, tok = hf_model
    adapter = get_engram(model)
    ids = torch.randint(2, tok.original_vocab_size, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    cut = []
    real_last_columns = decode_state.last_columns
    monkeypatch.setattr(decode_state, "last_columns", lambda *a: cut.append(1) or real_last_columns(*a))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
        assert not cut, "a decode step inside generate() cut a look-back state"
        seq = out.sequences
        nxt = torch.randint(2, tok.original_vocab_size, (2, 1), generator=torch.Generator().manual_seed(3))
        full_mask = torch.ones(2, seq.shape[1] + 1, dtype=mask.dtype)
        full_mask[:, : mask.shape[1]] = mask
        # generate() ends without the last token's forward: feed it with the next one.
        cache = out.past_key_values if getattr(out, "cache", None) is None else out.cache
        key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        model(torch.cat([seq[:, -1:], nxt], 1), attention_mask=full_mask, **{key: cache})
        assert len(cut) == 1
        cached_rows = adapter.last_row_ids
        model(torch.cat([seq, nxt], 1), attention_mask=full_mask)
    assert torch.equal(cached_rows, adapter.last_row_ids[:, -2:])


def test_positional_arguments_of_the_base_forward(hf_model):
    from condmem.integrations.transformers import get_engram

    model, tok = hf_model
    ids = torch.randint(2, tok.original_vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    adapter = get_engram(model)
    with torch.no_grad():
        by_name = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        rows_by_name = adapter.last_row_ids
        by_position = model.model(ids, mask).last_hidden_state
    assert torch.equal(adapter.last_row_ids, rows_by_name)
    assert torch.equal(by_position, by_name)
    assert torch.equal(rows_by_name, adapter.row_ids(ids, mask))
