"""Engine-style serving: one flat batch per step mixing prefill chunks, decode tokens and
speculative drafts under a token budget; a prefix-cache hit; sequences joining and leaving.

Every committed token's logits equal a full forward over its sequence (fp32 tolerance), the
greedy tokens equal a greedy full-forward rollout, and serving the Engram rows from an
`EngramMemory` (host tier; HBM on a GPU) gives the same logits as the model's own tables.
"""

from __future__ import annotations

import pytest
import torch

from condmem.serving import EngramMemory, ServingCache, ragged_step
from helpers import assert_close, devices
from model_fixtures import greedy_tokens, sharpen_attention, tiny_engram_lm

BUDGET = 10


def _serve(model, device, memory=None, spec_every: int = 2, seed: int = 0):
    """Run the schedule; returns {name: (tokens, {position: logits})}."""
    gen = torch.Generator().manual_seed(seed)
    prompts = {
        "a": torch.randint(0, 50, (13,), generator=gen).tolist(),
        "b": torch.randint(0, 50, (6,), generator=gen).tolist(),
        "c": torch.randint(0, 50, (9,), generator=gen).tolist(),
    }
    prompts["e"] = prompts["a"][:8] + torch.randint(0, 50, (4,), generator=gen).tolist()  # shares a's first 8
    new_tokens = {"a": 7, "b": 9, "c": 5, "e": 6}
    truth = {k: greedy_tokens(model, p, new_tokens[k] + 3, device) for k, p in prompts.items()}  # for right drafts
    cache = ServingCache(model, n_slots=3, max_len=40)
    free = [0, 1, 2]
    order = ["a", "b", "c", "e"]
    live: dict[str, dict] = {}
    done: dict[str, tuple] = {}
    drafts_seen = {"accepted": 0, "rejected": 0}
    step = 0
    while order or live:
        # Admit: e joins as a prefix-cache hit on a's first 8 tokens (KV copied, history seeded).
        while order and (memory.history._free if memory is not None else free):
            name = order[0]
            if name == "e" and "a" not in live:
                break
            order.pop(0)
            slot = memory.allocate() if memory is not None else free.pop(0)
            st = {"slot": slot, "tokens": list(prompts[name]), "done": 0, "new": 0, "logits": {}, "last": None}
            if name == "e":
                src = live["a"]["slot"]
                cache.copy_prefix(src, slot, 8)
                cache.lengths[slot] = 8
                cache.host_lengths[slot] = 8
                st["done"] = 8
                if memory is not None:
                    memory.seed([slot], torch.tensor([prompts["a"][6:8]]))
            live[name] = st
        spec = step % spec_every == 1
        slots, chunks, names, kinds = [], [], [], []
        budget = BUDGET
        for name, st in live.items():
            if budget <= 0:
                break
            left = len(prompts[name]) - st["done"]
            if left > 0:  # prefill chunk
                n = min(left, budget, 1 + (step + len(name)) % 5)
                chunk = st["tokens"][st["done"] : st["done"] + n]
                kinds.append(0)
            else:  # decode token (+ drafts)
                nxt = int(st["last"].argmax())
                chunk = [nxt]
                if spec and budget >= 3:
                    k = st["new"] + 1  # drafts: the true greedy tokens, one spoiled at times
                    drafts = truth[name][k : k + 2]
                    if (step + len(name)) % 3 == 0 and drafts:
                        drafts[-1] = (drafts[-1] + 1) % 50
                    chunk += drafts
                kinds.append(1)
            slots.append(st["slot"])
            chunks.append(torch.tensor(chunk))
            names.append(name)
            budget -= len(chunk)
        ids = torch.cat(chunks)
        cu = torch.tensor([0] + torch.tensor([len(c) for c in chunks]).cumsum(0).tolist())
        prepared = None
        if memory is not None:
            prepared = memory.prepare_ragged(ids, cu, slots=torch.tensor(slots), commit=not spec)
        # Verification needs the logits first: run with every chunk kept, then commit what is accepted.
        logits = ragged_step(
            model,
            cache,
            slots,
            [c.to(device) for c in chunks],
            prepared=prepared,
            n_commit=None if not spec else [len(c) for c in chunks],
        )
        n_commit = []
        for b, (name, kind, chunk) in enumerate(zip(names, kinds, chunks)):
            st = live[name]
            lg = logits[int(cu[b]) : int(cu[b + 1])]
            keep = len(chunk)
            if kind == 1 and len(chunk) > 1:  # accept drafts while the model agrees
                keep = 1
                while keep < len(chunk) and int(lg[keep - 1].argmax()) == int(chunk[keep]):
                    keep += 1
                drafts_seen["accepted"] += keep - 1
                drafts_seen["rejected"] += len(chunk) - keep
            n_commit.append(keep)
            for j in range(keep):
                pos = st["done"] + j
                if pos >= len(st["tokens"]):
                    st["tokens"].append(int(chunk[j]))
                    st["new"] += 1
                st["logits"][pos] = lg[j]
            st["done"] += keep
            st["last"] = lg[keep - 1]
        if spec:
            for s, c, keep in zip(slots, chunks, n_commit):
                cache.host_lengths[s] -= len(c) - keep
                cache.lengths[s] -= len(c) - keep
            if memory is not None:
                memory.commit(torch.tensor(slots), ids, cu, torch.tensor(n_commit))
        for name in list(live):
            st = live[name]
            if st["done"] >= len(prompts[name]) and st["new"] >= new_tokens[name]:
                done[name] = (st["tokens"], st["logits"])
                cache.release(st["slot"])
                memory.free(st["slot"]) if memory is not None else free.append(st["slot"])
                del live[name]
        step += 1
        assert step < 200
    assert drafts_seen["accepted"] > 0 and drafts_seen["rejected"] > 0, drafts_seen
    return done, truth


@pytest.mark.parametrize("device", devices())
def test_engine_schedule_matches_full_forward(device):
    model, _ = tiny_engram_lm(device, short_conv=False)
    sharpen_attention(model)
    with torch.no_grad():
        done, truth = _serve(model, device)
        assert set(done) == {"a", "b", "c", "e"}
        for name, (tokens, logits) in done.items():
            full = model(torch.tensor([tokens], device=device))[0]
            for pos, lg in logits.items():
                assert_close(f"{name} position {pos}", full[pos], lg, atol=2e-4, rtol=2e-4)
        # greedy: every generated token is the full-forward greedy continuation
        for name, (tokens, _) in done.items():
            prompt_len = {"a": 13, "b": 6, "c": 9, "e": 12}[name]
            gen_tokens = tokens[prompt_len:]
            assert gen_tokens == truth[name][: len(gen_tokens)], name


@pytest.mark.parametrize("device", devices())
def test_engine_schedule_from_engram_memory_equals_own_tables(device):
    model, tables = tiny_engram_lm(device, short_conv=False)
    tiers = ["host"] + (["hbm"] if device != "cpu" else [])
    with torch.no_grad():
        plain, _ = _serve(model, device)
        for tier in tiers:
            memory = EngramMemory.from_weights(
                model.hasher,
                tables,
                tier,
                device,
                max_sequences=3,
                host_alloc="pageable" if device == "cpu" else "mmap_register",
            )
            served, _ = _serve(model, device, memory=memory)
            assert plain.keys() == served.keys()
            for name in plain:
                assert plain[name][0] == served[name][0], (tier, name)
                for pos, lg in plain[name][1].items():
                    assert torch.equal(lg, served[name][1][pos]), (tier, name, pos)
            memory.close()


def test_ragged_step_refuses_what_it_cannot_serve():
    model, _ = tiny_engram_lm("cpu", short_conv=True)
    cache = ServingCache(model, n_slots=2, max_len=8)
    with pytest.raises(ValueError, match="ShortConv"):
        ragged_step(model, cache, [0], [torch.tensor([1, 2])])
    model, _ = tiny_engram_lm("cpu", short_conv=False)
    cache = ServingCache(model, n_slots=2, max_len=8)
    with pytest.raises(ValueError, match="does not fit"):
        ragged_step(model, cache, [0], [torch.arange(9)])
    with pytest.raises(ValueError, match="distinct"):
        ragged_step(model, cache, [0, 0], [torch.tensor([1]), torch.tensor([2])])
