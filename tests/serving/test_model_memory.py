"""The reference LM with its tables served by EngramMemory gives torch.equal logits, prefill and decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from condmem.models.transformer import DecoderLM
from condmem.serving import EngramMemory
from helpers import devices
from model_fixtures import tiny_engram_lm as _model


@pytest.mark.parametrize("device", devices())
def test_prefill_and_decode_logits_equal_with_prefetched_host_tables(device):
    model, tables = _model(device)
    memory = EngramMemory.from_weights(
        model.hasher,
        tables,
        "host",
        device,
        host_alloc="pageable" if device == "cpu" else "mmap_register",
        max_sequences=8,
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        ids = torch.randint(0, 50, (3, 17), generator=gen).to(device)
        assert torch.equal(model(ids, prepared=memory.prepare(ids)), model(ids))

        batch = 4
        prompt = torch.randint(0, 50, (batch, 9), generator=gen).to(device)
        slots = torch.tensor([memory.allocate() for _ in range(batch)])
        ref_cache, cache = model.new_cache(batch, 64), model.new_cache(batch, 64)
        ref = model(prompt, cache=ref_cache)
        got = model(prompt, cache=cache, prepared=memory.prepare(prompt, slots=slots))
        assert torch.equal(got, ref)
        for _ in range(24):
            nxt = ref[:, -1].argmax(-1)
            ref = model(nxt[:, None], cache=ref_cache)
            got = model(nxt[:, None], cache=cache, prepared=memory.prepare_decode(slots, nxt))
            assert torch.equal(got, ref)
    memory.close()


def test_generate_with_memory_equals_generate_with_module_tables():
    from condmem.models.generate import generate

    model, tables = _model("cpu")
    memory = EngramMemory.from_weights(model.hasher, tables, "host", "cpu", host_alloc="pageable", max_sequences=4)
    prompt = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(3))
    plain = generate(model, prompt, 20, temperature=0)
    with_memory = generate(model, prompt, 20, temperature=0, memory=memory)
    assert torch.equal(plain, with_memory)
    assert memory.history.ids.shape[0] == 4 and len(memory.history._live) == 0  # slots given back


def test_model_with_meta_tables_runs_from_memory_only():
    """Tables larger than the device: the model holds none (meta) and reads every row from EngramMemory."""
    from condmem.module import EngramInputError

    model, tables = _model("cpu")
    lean = DecoderLM(model.cfg, token_lookup=np.arange(50) % 40, sparse_tables=False, table_device="meta").eval()
    lean.load_state_dict({k: v for k, v in model.state_dict().items() if not k.endswith("table.weight")}, strict=False)
    assert all(b.engram.table.weight.is_meta for b in lean.blocks if b.engram is not None)
    memory = EngramMemory.from_weights(model.hasher, tables, "host", "cpu", host_alloc="pageable", max_sequences=2)
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(lean(ids, prepared=memory.prepare(ids)), model(ids))
        with pytest.raises(EngramInputError, match="lives outside this module"):
            lean(ids)
