"""The chunked-prefill scheduler: requests arriving over time, prompts cut by a small token
budget and mixed with decode tokens, slots reused; every request's tokens equal a greedy
full-forward rollout, and Engram rows served by an EngramMemory give the same tokens."""

from __future__ import annotations

import pytest
import torch

from condmem.serving import EngramMemory, Scheduler, ServingCache
from helpers import devices
from model_fixtures import greedy_tokens, sharpen_attention, tiny_engram_lm


def _serve(model, device, memory=None, budget=7, lookahead=True, spy=None):
    gen = torch.Generator().manual_seed(4)
    prompts = {
        k: torch.randint(0, 50, (n,), generator=gen).tolist()
        for k, n in (("a", 13), ("b", 3), ("c", 9), ("d", 1), ("e", 17))
    }
    news = {"a": 6, "b": 9, "c": 1, "d": 5, "e": 4}
    sched = Scheduler(
        model, ServingCache(model, n_slots=3, max_len=40), memory=memory, token_budget=budget, lookahead=lookahead
    )
    if spy is not None:
        spy(sched)
    for k in ("a", "b", "c"):
        sched.submit(k, prompts[k], news[k])
    sched.step()
    sched.step()
    sched.submit("d", prompts["d"], news["d"])  # arrive while others run
    sched.step()
    sched.submit("e", prompts["e"], news["e"])
    done = sched.run()
    return prompts, news, done, sched.steps


@pytest.mark.parametrize("device", devices())
def test_chunked_prefill_schedule_generates_the_greedy_tokens(device):
    model, _ = tiny_engram_lm(device, short_conv=False)
    sharpen_attention(model)
    with torch.no_grad():
        prompts, news, done, steps = _serve(model, device)
        assert set(done) == set(prompts)
        for k in prompts:
            assert done[k] == greedy_tokens(model, prompts[k], news[k], device), k
        assert steps >= sum(len(p) for p in prompts.values()) // 7, "the budget cut the prompts"


@pytest.mark.parametrize("device", devices())
def test_schedule_from_engram_memory_gives_the_same_tokens(device):
    model, tables = tiny_engram_lm(device, short_conv=False)
    with torch.no_grad():
        _, _, plain, _ = _serve(model, device)
        memory = EngramMemory.from_weights(
            model.hasher,
            tables,
            "host",
            device,
            max_sequences=3,
            host_alloc="pageable" if device == "cpu" else "mmap_register",
        )
        _, _, served, _ = _serve(model, device, memory=memory)
        memory.close()
    assert served == plain


def test_scheduler_refuses_what_does_not_fit():
    model, _ = tiny_engram_lm("cpu", short_conv=False)
    sched = Scheduler(model, ServingCache(model, n_slots=2, max_len=10))
    with pytest.raises(ValueError, match="exceed"):
        sched.submit("x", list(range(8)), 5)
    with pytest.raises(ValueError, match="empty"):
        sched.submit("y", [], 1)
    with pytest.raises(ValueError, match="token_budget"):
        Scheduler(model, ServingCache(model, n_slots=2, max_len=10), token_budget=0)


@pytest.mark.parametrize("budget", [2, 7])
def test_lookahead_starts_the_next_prefill_before_sampling_and_changes_no_token(budget, monkeypatch):
    """With lookahead, the next step's prefill chunks are hashed and their lookups started while
    the step's forward is queued, before its logits are read; every step stays within the
    budget (also when decode tokens alone exceed it: budget 2, 3 slots); tokens equal the
    schedule without lookahead and the plain greedy rollout."""
    import condmem.serving.scheduler as sched_mod

    model, tables = tiny_engram_lm("cpu", short_conv=False)
    order, sizes = [], []
    real_step = sched_mod.ragged_step

    def ragged_step(model_, cache, slots, chunks, **kw):
        sizes.append(sum(int(c.numel()) for c in chunks))
        order.append("forward")
        return real_step(model_, cache, slots, chunks, **kw)

    monkeypatch.setattr(sched_mod, "ragged_step", ragged_step)

    def spy(sched):
        real_prepare = sched.memory.prepare_ragged

        def prepare_ragged(ids, cu, **kw):
            order.append("prepare")
            return real_prepare(ids, cu, **kw)

        sched.memory.prepare_ragged = prepare_ragged
        real_sched_step = sched.step

        def step():
            out = real_sched_step()
            order.append("sampled")
            return out

        sched.step = step

    results = {}
    with torch.no_grad():
        for lookahead in (False, True):
            memory = EngramMemory.from_weights(
                model.hasher, tables, "host", "cpu", max_sequences=3, host_alloc="pageable"
            )
            order.clear()
            sizes.clear()
            prompts, news, done, _ = _serve(model, "cpu", memory=memory, budget=budget, lookahead=lookahead, spy=spy)
            results[lookahead] = done
            assert max(sizes) <= budget
            memory.close()
            # A prepare between a step's forward and its sampling: the next step's prefill, with lookahead only.
            ahead = any(a == "forward" and b == "prepare" for a, b in zip(order, order[1:]))
            assert ahead == lookahead
    assert results[True] == results[False]
    for k in prompts:
        assert results[True][k] == greedy_tokens(model, prompts[k], news[k], "cpu"), k
