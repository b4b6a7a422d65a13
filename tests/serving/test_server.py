"""`WaveServer`: waves of packed prefill batches then decode, more prompts than slots; every
sequence's tokens equal a greedy full-forward rollout, with the model's own tables or an
`EngramMemory` (rows fetched one batch ahead, or waited for before each batch), and the
observer hears each phase in order."""

from __future__ import annotations

import pytest
import torch

from condmem.serving import EngramMemory, ServingCache, WaveObserver, WaveServer
from condmem.serving.server import pack
from helpers import devices
from model_fixtures import greedy_tokens, sharpen_attention, tiny_engram_lm

GEN = 4


def _prompts():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 50, (n,), generator=gen) for n in (7, 2, 11, 5, 1, 9, 4)]


def _memory(model, tables, device, n_slots):
    return EngramMemory.from_weights(
        model.hasher,
        tables,
        "host",
        device,
        max_sequences=n_slots,
        host_alloc="pageable" if device == "cpu" else "mmap_register",
    )


def test_pack_cuts_consecutive_prompts_at_the_token_budget():
    assert pack([5, 3, 9, 2, 2], 8) == [[0, 1], [2], [3, 4]]
    assert pack([], 8) == []


@pytest.mark.parametrize("device", devices())
def test_waves_generate_the_greedy_tokens_with_and_without_a_memory(device):
    """3 slots for 7 prompts (3 waves, the last short), batches of <= 12 prompt tokens (several per wave)."""
    model, tables = tiny_engram_lm(device, short_conv=False)
    sharpen_attention(model)
    prompts = _prompts()
    with torch.no_grad():
        want = torch.tensor([greedy_tokens(model, p.tolist(), GEN, device) for p in prompts])
        cache = ServingCache(model, n_slots=3, max_len=32)
        with WaveServer(model, cache, prefill_tokens=12) as server:
            plain = server.serve(prompts, GEN)
        assert torch.equal(plain.cpu(), want)
        memory = _memory(model, tables, device, 3)
        try:
            for wait in ("at_layer", "before_step"):
                with WaveServer(model, cache, memory, wait=wait, prefill_tokens=12) as server:
                    assert torch.equal(server.serve(prompts, GEN).cpu(), want), wait
                assert cache.host_lengths == [0, 0, 0]  # every wave released its slots
        finally:
            memory.close()


def test_the_observer_hears_every_phase_in_order():
    model, tables = tiny_engram_lm("cpu", short_conv=False)
    calls = []

    class Spy(WaveObserver):
        def wave_started(self):
            calls.append("wave")

        def batch_queued(self):
            calls.append("queued")

        def batch_launching(self):
            calls.append("launching")

        def batch_launched(self):
            calls.append("launched")

        def prefill_done(self):
            calls.append("prefill")

        def decode_done(self, prepared):
            calls.append(f"decode/{len(prepared)}")

    prompts = _prompts()[:3]  # 7 + 2 tokens in one batch, then 11
    memory = _memory(model, tables, "cpu", 3)
    try:
        with (
            torch.no_grad(),
            WaveServer(model, ServingCache(model, n_slots=3, max_len=32), memory, prefill_tokens=10) as server,
        ):
            server.serve(prompts, 2, observer=Spy())
    finally:
        memory.close()
    batch = ["queued", "launching", "launched"]
    assert calls == ["wave", *batch, *batch, "prefill", "decode/2"]


def test_the_server_refuses_what_it_cannot_serve():
    model, tables = tiny_engram_lm("cpu", short_conv=False)
    cache = ServingCache(model, n_slots=2, max_len=16)
    with pytest.raises(ValueError, match="wait"):
        WaveServer(model, cache, wait="later")
    with pytest.raises(ValueError, match="prefill_tokens"):
        WaveServer(model, cache, prefill_tokens=0)
    memory = _memory(model, tables, "cpu", 1)
    try:
        with pytest.raises(ValueError, match="history"):
            WaveServer(model, cache, memory)
    finally:
        memory.close()
    server = WaveServer(model, cache)
    prompts = server.stage(_prompts()[:3])
    with pytest.raises(ValueError, match="wave of 3"):
        server.wave(prompts, 2)
    with pytest.raises(ValueError, match="gen"):
        server.wave(prompts[:1], 0)
