"""CUDA-graph decode: replays match eager steps; rows from prefetched host tables are exact (GPU only)."""

from __future__ import annotations

import pytest
import torch

from condmem.models.graphs import GraphedDecoder
from condmem.models.serving import ServingCache, decode_step, prefill
from condmem.runtime import EngramMemory
from helpers import assert_close
from model_fixtures import tiny_engram_lm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _run(model, memory=None, graphed=True, steps=12):
    """Two sequences, a third joins at step 4 and the first leaves at step 8; per-step logits."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 50, (n,), generator=gen).cuda() for n in (6, 3, 8)]
    cache = ServingCache(model, n_slots=4, max_len=64)           # 3 sequences + the scratch slot
    graph = GraphedDecoder(model, cache, rows=3, with_memory=memory is not None) if graphed else None
    live, last, out = [], {}, []

    def join(i):
        slot = memory.allocate() if memory is not None else i
        prep = memory.prepare(prompts[i][None], slots=torch.tensor([slot])) if memory is not None else None
        last[slot] = prefill(model, cache, slot, prompts[i], prepared=prep)[-1]
        live.append(slot)

    join(0), join(1)
    for step in range(steps):
        if step == 4:
            join(2)
        if step == 8:
            slot = live.pop(0)
            cache.release(slot)
            if memory is not None:
                memory.free(slot)
        slots = torch.tensor(live, device="cuda")
        nxt = torch.stack([last[s].argmax() for s in live])
        prep = memory.prepare_decode(slots, nxt) if memory is not None else None
        logits = graph.step(slots, nxt, prepared=prep) if graphed else decode_step(model, cache, slots, nxt,
                                                                                  prepared=prep)
        logits = logits.clone()
        for i, s in enumerate(live):
            last[s] = logits[i]
        out.append(logits)
    return out


def test_graph_replay_matches_eager_steps():
    model, _ = tiny_engram_lm("cuda")
    with torch.no_grad():
        eager, graphed = _run(model, graphed=False), _run(model, graphed=True)
    for i, (a, b) in enumerate(zip(eager, graphed)):
        assert_close(f"step {i}", a, b, atol=1e-4, rtol=1e-4)


def test_graph_with_prefetched_host_rows_is_exact():
    model, tables = tiny_engram_lm("cuda")
    memory = EngramMemory.from_weights(model.hasher, tables, "host", "cuda", max_sequences=4)
    with torch.no_grad():
        plain, served = _run(model, graphed=True), _run(model, memory=memory, graphed=True)
    for i, (a, b) in enumerate(zip(plain, served)):
        assert torch.equal(a, b), f"step {i}"
    memory.close()
