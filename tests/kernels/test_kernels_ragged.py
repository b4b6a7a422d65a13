"""Ragged hashing for serving engines: any chunking, prefix-cache boundary, interleaving with
decode, speculative acceptance and preemption gives every token the row ids of its whole
sequence hashed at once (torch.equal), on the torch reference and the Triton kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from condmem import EngramConfig, EngramLayout, NgramHasher
from condmem.hashing.hasher import HashInputError
from kernel_helpers import INTERPRET, kernel_devices, needs_kernels

pytestmark = needs_kernels
DEVICES = kernel_devices()


def _hasher(max_n: int, seed: int) -> NgramHasher:
    gen = np.random.default_rng(seed)
    vocab = 40
    cfg = EngramConfig(
        layer_ids=[1, 4],
        max_ngram_size=max_n,
        n_heads=2,
        head_dim=8,
        table_size=[101, 53, 31][: max_n - 1],
        compressed_vocab_size=vocab,
        seed=seed % 3,
    )
    table = np.concatenate([np.arange(vocab), gen.integers(0, vocab, 25)])
    gen.shuffle(table)
    return NgramHasher(EngramLayout(cfg), token_lookup=table)


def _lookback(ids: np.ndarray, blocked: np.ndarray, at: int, depth: int) -> list[int]:
    """Token ids before position `at`, oldest first; -1 before the start or behind a block."""
    out = []
    hidden = False
    for m in range(depth):  # m+1 positions back
        q = at - 1 - m
        if q < 0 or hidden or blocked[q]:
            hidden = True
        out.append(-1 if hidden else int(ids[q]))
    return out[::-1]


class Sequence:
    def __init__(self, ids, blocked, truth):
        self.ids, self.blocked, self.truth = ids, blocked, truth
        self.done = 0  # tokens committed
        self.slot = -1


def run_schedule(
    hasher: NgramHasher,
    device,
    backend: str,
    rng: np.random.Generator,
    n_seqs: int,
    max_len: int,
    spec_prob: float,
    block_prob: float,
    handover_prob: float,
    preempt_prob: float,
) -> int:
    depth = hasher.layout.max_ngram_size - 1
    history = hasher.new_history(n_slots=max(2, n_seqs // 2 + 1), device=device)
    waiting, running, checked = [], [], 0
    for _ in range(n_seqs):
        length = int(rng.integers(1, max_len + 1))
        ids = rng.integers(0, hasher.vocab_size, length)
        blocked = rng.random(length) < block_prob
        truth = hasher(
            torch.as_tensor(ids)[None].to(device), blocked=torch.as_tensor(blocked)[None].to(device), backend="torch"
        )[0]
        seq = Sequence(ids, blocked, truth)
        seq.done = int(rng.integers(0, length)) if rng.random() < 0.4 else 0  # a prefix-cache hit
        waiting.append(seq)
    while waiting or running:
        # Admit while slots last; a prefix-cache hit seeds the slot from the tokens before it.
        while waiting and history._free:
            seq = waiting.pop()
            seq.slot = history.allocate()
            if seq.done:
                lb = torch.tensor([_lookback(seq.ids, seq.blocked, seq.done, depth)], device=device)
                hasher.seed_history(history, torch.tensor([seq.slot], device=device), lb)
            running.append(seq)
        batch = [s for s in running if rng.random() < 0.8] or running[:1]
        rng.shuffle(batch)
        spec = rng.random() < spec_prob
        chunks, accepted = [], []
        for s in batch:
            left = len(s.ids) - s.done
            n_real = int(rng.integers(1, left + 1)) if rng.random() < 0.5 else 1
            if spec:  # [true tokens..., then drafts that will be rejected]
                n_acc = int(rng.integers(0, n_real + 1))
                drafts = rng.integers(0, hasher.vocab_size, int(rng.integers(0, 3)))
                chunk = np.concatenate([s.ids[s.done : s.done + n_acc], drafts]).astype(np.int64)
                if len(chunk) == 0:
                    chunk = rng.integers(0, hasher.vocab_size, 1)
                cblocked = np.concatenate([s.blocked[s.done : s.done + n_acc], np.zeros(len(chunk) - n_acc, bool)])
                accepted.append(n_acc)
            else:
                chunk = s.ids[s.done : s.done + n_real]
                cblocked = s.blocked[s.done : s.done + n_real]
                accepted.append(len(chunk))
            chunks.append((chunk, cblocked))
        # Some sequences are handed over from elsewhere: no slot here, explicit look-back ids.
        handed = [rng.random() < handover_prob and not spec for _ in batch]
        pad = int(rng.integers(0, 4))
        flat = np.concatenate([c for c, _ in chunks] + [rng.integers(0, hasher.vocab_size, pad)]).astype(np.int64)
        flat_blocked = np.concatenate([b for _, b in chunks] + [rng.random(pad) < 0.5])
        cu = np.concatenate([[0], np.cumsum([len(c) for c, _ in chunks])])
        slots = torch.tensor([-1 if h else s.slot for s, h in zip(batch, handed)], device=device)
        lookback = torch.tensor([_lookback(s.ids, s.blocked, s.done, depth) for s in batch], device=device)
        args = dict(
            history=history,
            slots=slots,
            lookback_ids=lookback if any(handed) else None,
            blocked=torch.as_tensor(flat_blocked, device=device),
            backend=backend,
        )
        flat_t, cu_t = torch.as_tensor(flat, device=device), torch.as_tensor(cu, device=device)
        rows = hasher.hash_ragged(flat_t, cu_t, commit=not spec, **args)
        if spec:
            hasher.commit(
                history,
                slots,
                flat_t,
                cu_t,
                torch.tensor(accepted, device=device),
                blocked=args["blocked"],
                backend=backend,
            )
        for b, (s, h) in enumerate(zip(batch, handed)):
            n_ok = accepted[b]
            got = rows[cu[b] : cu[b] + n_ok]
            want = s.truth[s.done : s.done + n_ok]
            assert torch.equal(got, want), f"sequence tokens {s.done}..{s.done + n_ok} (spec={spec}, handed={h})"
            checked += n_ok
            if h:
                # A handed-over chunk wrote nothing: the engine re-seeds the slot as it would on arrival.
                hasher.seed_history(
                    history,
                    torch.tensor([s.slot], device=device),
                    torch.tensor([_lookback(s.ids, s.blocked, s.done + n_ok, depth)], device=device),
                )
            s.done += n_ok
        padding_rows = rows[cu[-1] :]
        offsets = hasher.constants(device)["offsets"]
        assert torch.equal(padding_rows, offsets.expand_as(padding_rows)), "padding tokens hold bucket 0 + offset"
        for s in list(running):
            if s.done == len(s.ids):
                history.free(s.slot)
                running.remove(s)
            elif rng.random() < preempt_prob:  # preempted: slot freed, re-admitted later as a prefix hit
                history.free(s.slot)
                running.remove(s)
                waiting.insert(0, s)
    return checked


BACKENDS = ["torch", "triton"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@settings(
    max_examples=12 if INTERPRET else 60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    seed=st.integers(0, 2**31 - 1),
    max_n=st.sampled_from([2, 3, 4]),
    n_seqs=st.integers(1, 6),
    spec_prob=st.sampled_from([0.0, 0.5]),
    block_prob=st.sampled_from([0.0, 0.15]),
    handover_prob=st.sampled_from([0.0, 0.3]),
    preempt_prob=st.sampled_from([0.0, 0.2]),
)
def test_any_schedule_hashes_like_whole_sequences(
    device, backend, seed, max_n, n_seqs, spec_prob, block_prob, handover_prob, preempt_prob
):
    hasher = _hasher(max_n, seed)
    rng = np.random.default_rng(seed)
    checked = run_schedule(hasher, device, backend, rng, n_seqs, 14, spec_prob, block_prob, handover_prob, preempt_prob)
    assert checked > 0


@pytest.mark.parametrize("device", DEVICES)
def test_triton_equals_reference_on_one_mixed_batch(device):
    """Prefill chunks, decode tokens, drafts and padding in one flat batch: kernel == reference,
    rows and the advanced history."""
    hasher = _hasher(4, 3)
    gen = torch.Generator().manual_seed(0)
    lengths = [37, 1, 1, 5, 0, 1, 12, 1]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), device=device)
    n = int(cu[-1]) + 7
    ids = torch.randint(0, hasher.vocab_size, (n,), generator=gen).to(device)
    blocked = (torch.rand(n, generator=gen) < 0.1).to(device)
    results = []
    for backend in BACKENDS:
        history = hasher.new_history(16, device)
        for _ in range(10):
            history.allocate()
        history.ids.copy_(
            torch.randint(0, hasher.layout.compressed_vocab_size, history.ids.shape, generator=gen).to(device)
        )
        slots = torch.tensor([3, 0, 9, -1, 5, 2, 7, 4], device=device)
        lookback = torch.randint(-1, hasher.vocab_size, (len(lengths), 3), generator=gen).to(device)
        rows = hasher.hash_ragged(
            ids, cu, history=history, slots=slots, lookback_ids=lookback, blocked=blocked, backend=backend
        )
        results.append((rows, history.ids.clone()))
        gen.manual_seed(0)
        torch.randint(0, hasher.vocab_size, (n,), generator=gen)
        torch.rand(n, generator=gen)
    assert torch.equal(results[0][0], results[1][0]), "rows"
    assert torch.equal(results[0][1], results[1][1]), "history"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_ids_and_boundaries_are_named(device, backend):
    hasher = _hasher(3, 1)
    ids = torch.tensor([1, 2, hasher.vocab_size + 5, 3], device=device)
    cu = torch.tensor([0, 2, 4], device=device)
    with pytest.raises(HashInputError, match=f"token id {hasher.vocab_size + 5} is outside"):
        hasher.hash_ragged(ids, cu, backend=backend)
        hasher.raise_pending()
    ok = torch.tensor([1, 2, 3, 4], device=device)
    for bad_cu in ([1, 2, 4], [0, 3, 2], [0, 2, 9]):
        with pytest.raises(HashInputError, match="cu_seqlens"):
            hasher.hash_ragged(ok, torch.tensor(bad_cu, device=device), backend=backend)
            hasher.raise_pending()
    # An id past the live tokens is padding: never checked.
    hasher.hash_ragged(ids, torch.tensor([0, 2], device=device), backend=backend)
    hasher.raise_pending()
    with pytest.raises(HashInputError, match="flat"):
        hasher.hash_ragged(ids[None], cu, backend=backend)
    with pytest.raises(HashInputError, match="history and slots"):
        hasher.hash_ragged(ok, cu, slots=torch.tensor([0, 1], device=device), backend=backend)
    with pytest.raises(HashInputError, match="lookback_ids"):
        hasher.hash_ragged(ok, cu, lookback_ids=torch.zeros(2, 5, dtype=torch.int64, device=device), backend=backend)


def _v41_hasher() -> NgramHasher:
    """DeepSeek-V4.1-Flash geometry; token ids through a random map onto its V' = 99,092."""
    cfg = EngramConfig.deepseek_v41_flash()
    gen = np.random.default_rng(0)
    v = 99_092
    lookup = np.concatenate([np.arange(v), gen.integers(0, v, 129_280 - v)])
    gen.shuffle(lookup)
    return NgramHasher(EngramLayout(cfg, compressed_vocab_size=v), token_lookup=lookup)


@pytest.mark.gpu
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), spec_prob=st.sampled_from([0.0, 0.5]))
def test_v41_geometry_any_schedule(seed, spec_prob):
    hasher = _v41_hasher()
    checked = run_schedule(hasher, "cuda", "triton", np.random.default_rng(seed), 8, 40, spec_prob, 0.05, 0.2, 0.2)
    assert checked > 0


@pytest.mark.gpu
def test_default_checked_calls_never_wait_for_the_gpu():
    """The default (validating) calls return while a GPU sleep queued before them still runs;
    the negative control (`raise_pending(block=True)`) does wait, so the test can see a sync."""
    import time

    hasher = _v41_hasher()
    ids = torch.randint(0, hasher.vocab_size, (2, 8192), device="cuda")
    flat, cu = ids.reshape(-1), torch.tensor([0, 8192, 16384], device="cuda")
    hasher(ids)
    hasher.hash_ragged(flat, cu)
    torch.cuda.synchronize()
    sleep_cycles = int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 0.3)  # ~0.3 s
    torch.cuda._sleep(sleep_cycles)
    t0 = time.perf_counter()
    hasher(ids)
    hasher.hash_ragged(flat, cu)
    returned = time.perf_counter() - t0
    marker = torch.cuda.Event()
    marker.record()
    assert not marker.query(), "the GPU finished the sleep before the calls returned: the test cannot tell"
    assert returned < 0.1, f"the default hash calls took {returned * 1e3:.0f} ms behind a 300 ms GPU sleep"
    t0 = time.perf_counter()
    hasher.raise_pending(block=True)
    assert time.perf_counter() - t0 > 0.05, "the negative control did not wait"


@pytest.mark.gpu
def test_bad_id_on_the_gpu_is_raised_later_not_lost():
    hasher = _v41_hasher()
    ids = torch.randint(0, hasher.vocab_size, (1, 4096), device="cuda")
    ids[0, 1234] = hasher.vocab_size + 7
    torch.cuda._sleep(int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 0.1))
    hasher(ids)  # returns: the GPU is still busy
    with pytest.raises(HashInputError, match=f"token id {hasher.vocab_size + 7}"):
        hasher.raise_pending()
    hasher.raise_pending()  # reported once


@pytest.mark.gpu
def test_ragged_hash_and_commit_replay_in_a_cuda_graph():
    """A fixed token budget captured once replays any schedule that fits: unused sequences are
    empty (repeated boundaries) with slot -1, unused tokens are padding; rows and histories equal
    the eager calls."""
    hasher = _v41_hasher()
    budget, max_seqs, n_slots = 64, 8, 16
    static_ids = torch.zeros(budget, dtype=torch.int64, device="cuda")
    static_cu = torch.zeros(max_seqs + 1, dtype=torch.int64, device="cuda")
    static_slots = torch.full((max_seqs,), -1, dtype=torch.int64, device="cuda")
    static_commit = torch.zeros(max_seqs, dtype=torch.int64, device="cuda")
    graph_hist, eager_hist = hasher.new_history(n_slots, "cuda"), hasher.new_history(n_slots, "cuda")
    for _ in range(3):  # compile outside the capture
        hasher.hash_ragged(static_ids, static_cu, history=graph_hist, slots=static_slots, commit=False, check=False)
        hasher.commit(graph_hist, static_slots, static_ids, static_cu, static_commit)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_rows = hasher.hash_ragged(
            static_ids, static_cu, history=graph_hist, slots=static_slots, commit=False, check=False
        )
        hasher.commit(graph_hist, static_slots, static_ids, static_cu, static_commit)
    rng = np.random.default_rng(0)
    for step in range(20):
        b = int(rng.integers(1, max_seqs + 1))
        lengths = rng.integers(1, budget // max_seqs + 1, b)
        slots = rng.choice(n_slots, b, replace=False)
        ids = rng.integers(0, hasher.vocab_size, int(lengths.sum()))
        commit = np.array([int(rng.integers(0, n + 1)) for n in lengths])
        cu = np.concatenate([[0], np.cumsum(lengths)])
        static_ids.zero_()
        static_ids[: len(ids)] = torch.as_tensor(ids)
        static_cu.copy_(torch.as_tensor(np.concatenate([cu, np.full(max_seqs - b, cu[-1])])))
        static_slots.copy_(torch.as_tensor(np.concatenate([slots, np.full(max_seqs - b, -1)])))
        static_commit.copy_(torch.as_tensor(np.concatenate([commit, np.zeros(max_seqs - b, int)])))
        graph.replay()
        e_ids, e_cu = torch.as_tensor(ids, device="cuda"), torch.as_tensor(cu, device="cuda")
        e_slots = torch.as_tensor(slots, device="cuda")
        want = hasher.hash_ragged(e_ids, e_cu, history=eager_hist, slots=e_slots, commit=False)
        hasher.commit(eager_hist, e_slots, e_ids, e_cu, torch.as_tensor(commit, device="cuda"))
        assert torch.equal(static_rows[: len(ids)], want), f"step {step}: rows"
        assert torch.equal(graph_hist.ids, eager_hist.ids), f"step {step}: histories"
