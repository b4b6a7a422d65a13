"""The scheduler under bad requests and faults: `submit` refuses what it could not serve (naming the
request and the problem), and a step that raises fails only the request whose own step raises; every
other request gives exactly its greedy full-forward tokens. Each test has a negative control: the
old behaviour, restored by a monkeypatch, fails it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import condmem.serving.scheduler as sched_mod
from condmem.serving import EngramMemory, RequestFailed, Scheduler, ServingCache
from model_fixtures import greedy_tokens, sharpen_attention, tiny_engram_lm

N_GOOD = 50


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one thread is ~10x faster than several on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def lm():
    model, tables = tiny_engram_lm("cpu", short_conv=False)
    sharpen_attention(model)
    return model, tables


@pytest.fixture(scope="module")
def good(lm):
    """50 requests {rid: (prompt, max_new_tokens)} and each one's greedy tokens, run alone by full forwards."""
    model, _ = lm
    gen = torch.Generator().manual_seed(11)
    reqs = {}
    for i in range(N_GOOD):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        reqs[f"r{i}"] = (
            torch.randint(0, 50, (n,), generator=gen).tolist(),
            int(torch.randint(1, 5, (1,), generator=gen)),
        )
    expected = {rid: greedy_tokens(model, p, k, "cpu") for rid, (p, k) in reqs.items()}
    return reqs, expected


@pytest.fixture
def make(lm):
    """make(memory) -> a Scheduler of 4 slots and a 9-token budget (with an EngramMemory, closed after the test)."""
    memories = []

    def build(memory: bool) -> Scheduler:
        model, tables = lm
        mem = None
        if memory:
            mem = EngramMemory.from_weights(model.hasher, tables, "host", "cpu", max_sequences=4, host_alloc="pageable")
            memories.append(mem)
        return Scheduler(model, ServingCache(model, n_slots=4, max_len=40), memory=mem, token_budget=9)

    yield build
    for mem in memories:
        mem.close()


def _assert_served(done, good):
    reqs, expected = good
    for rid in reqs:
        assert not isinstance(done[rid], RequestFailed), done[rid]
        assert torch.equal(torch.tensor(done[rid]), torch.tensor(expected[rid])), rid


def _unchecked_submit(monkeypatch):
    """The old `submit`: the prompt cast to ints, nothing else checked."""

    def old(self, rid, prompt, max_new_tokens):
        return [int(t) for t in (prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)]

    monkeypatch.setattr(Scheduler, "_check", old)


def _no_isolation(monkeypatch):
    """The old step: an error in a step propagates out of `run` (and the step is left as it was)."""

    def old(self, decode, prefill):
        raise

    monkeypatch.setattr(Scheduler, "_one_by_one", old)


# ------------------------------------------------------------------------------------------- bad among good
def test_one_bad_request_among_50_is_refused_at_submit_and_the_50_are_served(make, good):
    reqs, _ = good
    sched = make(False)
    for i, (rid, (prompt, k)) in enumerate(reqs.items()):
        sched.submit(rid, prompt, k)
        if i == 20:
            with pytest.raises(ValueError, match=r"request 'bad': prompt token 1 is id 60, outside .* 0\.\.49"):
                sched.submit("bad", [3, 60, 4], 3)
    assert "bad" not in sched._pending and len(sched.waiting) == N_GOOD
    done = sched.run()
    assert set(done) == set(reqs)
    _assert_served(done, good)


@pytest.mark.parametrize("memory", [False, True], ids=["model_tables", "engram_memory"])
def test_a_bad_request_past_submit_fails_alone_in_run(make, good, memory, monkeypatch):
    """The check bypassed: the bad ids raise inside a step (the embedding or the hasher); the step
    is rewound and run one request at a time, the bad request finishes with its error, the 50 others
    with their greedy tokens; the scheduler keeps serving."""
    reqs, _ = good
    _unchecked_submit(monkeypatch)
    sched = make(memory)
    for i, (rid, (prompt, k)) in enumerate(reqs.items()):
        sched.submit(rid, prompt, k)
        if i == 20:
            sched.submit("bad", [3, 60, 4], 3)
    done = sched.run()
    assert set(done) == {*reqs, "bad"}
    assert isinstance(done["bad"], RequestFailed) and done["bad"].rid == "bad" and done["bad"].tokens == []
    assert isinstance(done["bad"].__cause__, (IndexError, ValueError)), repr(done["bad"].__cause__)
    _assert_served(done, good)
    # Later runs are unaffected.
    prompt, k = reqs["r0"]
    sched.submit("again", prompt, k)
    assert sched.run() == {"again": good[1]["r0"]}


@pytest.mark.parametrize("memory", [False, True], ids=["model_tables", "engram_memory"])
def test_negative_control_without_checks_or_isolation_one_bad_request_stops_every_run(make, good, memory, monkeypatch):
    reqs, _ = good
    _unchecked_submit(monkeypatch)
    _no_isolation(monkeypatch)
    sched = make(memory)
    for rid, (prompt, k) in reqs.items():
        sched.submit(rid, prompt, k)
    sched.submit("bad", [3, 60, 4], 3)
    for _ in range(2):  # every later run raises the same error; the good requests are never all served
        with pytest.raises((IndexError, ValueError)):
            sched.run()
    assert len(sched.finished) < N_GOOD


# ----------------------------------------------------------------------------------- a fault inside run()
def _inject(monkeypatch, sched, victim: str):
    """`ragged_step` raises for every step that holds `victim` once it has fed back a generated token,
    after the step has run (the cache lengths and, with a memory, the histories of the whole batch
    advanced: the rewind must undo them)."""
    real = sched_mod.ragged_step
    raised = []

    def ragged_step(model, cache, slots, chunks, **kw):
        out = real(model, cache, slots, chunks, **kw)
        held = [r.slot for r in sched.running if r.rid == victim and r.generated]
        if held and held[0] in slots:
            raised.append(len(slots))
            raise RuntimeError(f"injected fault for {victim}")
        return out

    monkeypatch.setattr(sched_mod, "ragged_step", ragged_step)
    return raised


def _victim(reqs) -> str:
    return next(rid for rid, (prompt, k) in reqs.items() if k == 4 and int(rid[1:]) > 5)


@pytest.mark.parametrize("memory", [False, True], ids=["model_tables", "engram_memory"])
def test_a_fault_in_one_requests_step_is_isolated(make, good, memory, monkeypatch):
    """The victim fails mid-decode (two tokens out, two to go) in a batch with others."""
    reqs, expected = good
    victim = _victim(reqs)
    sched = make(memory)
    raised = _inject(monkeypatch, sched, victim)
    for rid, (prompt, k) in reqs.items():
        sched.submit(rid, prompt, k)
    done = sched.run()
    assert len(raised) == 2 and raised[0] > 1 and raised[1] == 1, "the batched step, then the victim's step alone"
    failed = done.pop(victim)
    assert isinstance(failed, RequestFailed) and isinstance(failed.__cause__, RuntimeError)
    assert "injected fault" in str(failed) and failed.rid == victim
    assert torch.equal(torch.tensor(failed.tokens), torch.tensor(expected[victim][:2])), "what it emitted before"
    _assert_served(done, ({r: v for r, v in reqs.items() if r != victim}, expected))


@pytest.mark.parametrize("memory", [False, True], ids=["model_tables", "engram_memory"])
def test_negative_control_a_fault_without_the_rewind_corrupts_the_others(make, good, memory, monkeypatch):
    """Rerun one at a time without setting the batch's slots back: the lengths (and histories) the
    failed step advanced stay advanced, and requests of that batch get wrong tokens."""
    reqs, expected = good
    monkeypatch.setattr(Scheduler, "_rewind", lambda self, req: None)
    sched = make(memory)
    victim = _victim(reqs)
    _inject(monkeypatch, sched, victim)
    for rid, (prompt, k) in reqs.items():
        sched.submit(rid, prompt, k)
    try:
        done = sched.run()
    except ValueError:  # a sequence pushed past the cache's positions
        done = None
    assert done is None or any(done[rid] != expected[rid] for rid in reqs if rid != victim)


def test_negative_control_a_fault_without_isolation_stops_the_run(make, good, monkeypatch):
    reqs, _ = good
    _no_isolation(monkeypatch)
    sched = make(False)
    _inject(monkeypatch, sched, _victim(reqs))
    for rid, (prompt, k) in reqs.items():
        sched.submit(rid, prompt, k)
    with pytest.raises(RuntimeError, match="injected"):
        sched.run()


# -------------------------------------------------------------------------------------------- submit checks
@pytest.mark.parametrize(
    "prompt, max_new, match",
    [
        ([1, 50], 2, r"prompt token 1 is id 50, outside the vocabulary's 0\.\.49"),
        ([-1, 2], 2, r"prompt token 0 is id -1, outside"),
        (torch.tensor([1, 2, 99]), 2, r"prompt token 2 is id 99"),
        (torch.tensor([1.0, 2.0]), 2, r"integer token ids, got a torch\.float32 tensor"),
        (torch.tensor([True, False]), 2, r"integer token ids, got a torch\.bool tensor"),
        ([1, 2.5], 2, r"prompt token 1 is 2\.5 \(float\), not an integer"),
        ([1.0, 2.0], 2, r"prompt token 0 is 1\.0 \(float\)"),
        ([True, 2], 2, r"prompt token 0 is True \(bool\)"),
        (np.array([1.0, 2.0]), 2, r"prompt token 0 is .*float64"),
        (torch.tensor([[1, 2]]), 2, r"1-D tensor \[T\], got shape \(1, 2\)"),
        ("hello", 2, r"token ids .* got str"),
        ([], 2, r"an empty prompt"),
        (torch.tensor([], dtype=torch.long), 2, r"an empty prompt"),
        ([1, 2], 0, r"max_new_tokens must be >= 1, got 0"),
        ([1, 2], -3, r"max_new_tokens must be >= 1, got -3"),
        ([1, 2], True, r"max_new_tokens must be an int, got True"),
        ([1, 2], 2.0, r"max_new_tokens must be an int, got 2\.0"),
        (list(range(30)), 20, r"30 \+ 20 tokens exceed the cache's 40 positions"),
    ],
    ids=lambda v: None,
)
def test_submit_refuses_naming_the_request_and_the_problem(make, prompt, max_new, match):
    sched = make(False)
    with pytest.raises(ValueError, match=r"^request 'q': .*" + match):
        sched.submit("q", prompt, max_new)
    assert not sched.waiting and not sched._pending, "nothing queued"
    assert sched.run() == {}


def test_submit_accepts_every_integer_form_and_the_vocabulary_edges(lm, make):
    """Negative control of the refusals: integer tensors of any width, numpy ints, ids 0 and V-1."""
    model, _ = lm
    forms = {
        "int32": torch.tensor([0, 49, 7], dtype=torch.int32),
        "uint8": torch.tensor([0, 49, 7], dtype=torch.uint8),
        "numpy": np.array([0, 49, 7]),
        "list": [0, 49, 7],
        "scalars": [torch.tensor(0), torch.tensor(49), torch.tensor(7)],
    }
    sched = make(False)
    for rid, prompt in forms.items():
        sched.submit(rid, prompt, np.int64(3))
    done = sched.run()
    ref = greedy_tokens(model, [0, 49, 7], 3, "cpu")
    assert all(done[rid] == ref for rid in forms)


def test_max_new_tokens_1_gives_one_token_and_0_is_refused_where_it_gave_one(make, monkeypatch):
    sched = make(False)
    sched.submit("one", [1, 2, 3], 1)
    assert [len(v) for v in sched.run().values()] == [1]
    with pytest.raises(ValueError, match="max_new_tokens"):
        sched.submit("zero", [1, 2, 3], 0)
    _unchecked_submit(monkeypatch)  # negative control: the old submit
    sched.submit("zero", [1, 2, 3], 0)
    assert len(sched.run()["zero"]) == 1, "the old behaviour: one token for max_new_tokens=0"


def test_float_prompts_are_refused_where_they_were_cast(make, monkeypatch):
    sched = make(False)
    with pytest.raises(ValueError, match="float"):
        sched.submit("f", [1.7, 2.2], 2)
    _unchecked_submit(monkeypatch)  # negative control: the old submit cast them silently
    sched.submit("f", [1.7, 2.2], 2)
    assert sched.waiting[0].prompt == [1, 2]


def test_request_ids_are_unique_until_their_results_are_collected(make, monkeypatch):
    sched = make(False)
    sched.submit("a", [1, 2, 3], 4)
    with pytest.raises(ValueError, match=r"request 'a': .* already waiting or running"):
        sched.submit("a", [4, 5], 2)  # waiting
    sched.step()
    assert sched.running and sched.running[0].rid == "a"
    with pytest.raises(ValueError, match=r"already waiting or running"):
        sched.submit("a", [4, 5], 2)  # running
    while sched.running:
        sched.step()
    with pytest.raises(ValueError, match=r"finished and its result was not collected yet"):
        sched.submit("a", [4, 5], 2)  # finished, not handed over
    first = sched.collect()
    assert list(first) == ["a"] and len(first["a"]) == 4
    sched.submit("a", [4, 5], 2)  # handed over: the id may be used again
    second = sched.run()
    assert len(second["a"]) == 2 and sched.run() == {}, "a result is handed over once"
    with pytest.raises(ValueError, match="hashable"):
        sched.submit(["unhashable"], [1], 1)
    # Negative control: the old submit took the duplicate and dropped the first result.
    _unchecked_submit(monkeypatch)
    sched.submit("d", [1, 2, 3], 4)
    sched.submit("d", [4, 5], 2)
    done = sched.run()
    assert len(done) == 1 and len(done["d"]) in (2, 4), "two requests, one result"


def test_a_model_with_shortconv_is_refused_when_the_scheduler_is_built():
    model, _ = tiny_engram_lm("cpu", short_conv=True)
    with pytest.raises(ValueError, match="without a ShortConv"):
        Scheduler(model, ServingCache(model, n_slots=2, max_len=16))
