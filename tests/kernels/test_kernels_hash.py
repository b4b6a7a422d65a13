"""Triton hash kernels (prefill and decode) against the torch reference, compared with torch.equal.

On CPU they run through the Triton interpreter at small sizes; on a GPU the same tests
run compiled, plus the full DeepSeek-V4.1-Flash geometry.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from condmem import EngramConfig, EngramLayout, NgramHasher
from condmem.hashing.history import HistoryError, NgramHistory
from condmem.ops.hash.reference import hash_decode_reference
from kernel_helpers import HAS_TRITON, INTERPRET, kernel_devices, kernel_devices_here, needs_kernels

pytestmark = needs_kernels
DEVICES = kernel_devices()


def _hasher(
    max_n=4,
    heads=3,
    layers=(1, 5),
    sizes=(101, 53, 999, 31),
    vocab=500,
    extra_tokens=100,
    seed=0,
    lookup=True,
    pad_id=None,
) -> NgramHasher:
    gen = np.random.default_rng(seed)
    cfg = EngramConfig(
        layer_ids=list(layers),
        max_ngram_size=max_n,
        n_heads=heads,
        head_dim=8,
        table_size=list(sizes[: max_n - 1]),
        compressed_vocab_size=vocab,
        seed=seed % 3,
    )
    table = None
    if lookup:
        table = np.concatenate([np.arange(vocab), gen.integers(0, vocab, extra_tokens)])
        gen.shuffle(table)
    return NgramHasher(EngramLayout(cfg), token_lookup=table, pad_id=pad_id)


# ---------------------------------------------------------------------------- prefill

PREFILL_CASES = [
    # (max_n, heads, layers, batch, length, blocked, lookup)
    (2, 1, (0,), 1, 1, "none", True),
    (3, 3, (1, 5), 3, 17, "random", True),
    (4, 8, (1, 14), 2, 33, "doc_starts", True),
    (5, 2, (2, 3, 7), 1, 9, "dense", False),
    (4, 3, (1,), 0, 5, "none", True),
    (4, 5, (3, 9), 4, 1, "random", False),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "case", PREFILL_CASES, ids=lambda c: f"N{c[0]}-H{c[1]}-L{len(c[2])}-B{c[3]}-T{c[4]}-{c[5]}-lut{int(c[6])}"
)
def test_prefill_equals_reference(case, device):
    max_n, heads, layers, batch, length, blocked, lookup = case
    hasher = _hasher(max_n, heads, layers, lookup=lookup, seed=batch * 31 + length)
    gen = torch.Generator().manual_seed(max_n * 100 + length)
    ids = torch.randint(0, hasher.vocab_size, (batch, length), generator=gen)
    ids[:, ::4] = hasher.layout.config.pad_id  # the pad id as a real token too
    kwargs = {}
    if blocked == "random":
        kwargs["blocked"] = torch.rand(batch, length, generator=gen) < 0.2
    elif blocked == "dense":
        kwargs["blocked"] = torch.rand(batch, length, generator=gen) < 0.7
    elif blocked == "doc_starts":
        starts = torch.rand(batch, length, generator=gen) < 0.15
        starts[:, 0] = True
        kwargs["doc_starts"] = starts
    ids = ids.to(device)
    kwargs = {k: v.to(device) for k, v in kwargs.items()}
    for with_offsets in (True, False):
        ref = hasher(ids, with_offsets=with_offsets, backend="torch", **kwargs)
        got = hasher(ids, with_offsets=with_offsets, backend="triton", **kwargs)
        assert got.dtype == torch.int64 and got.device == ids.device
        assert torch.equal(ref, got), f"with_offsets={with_offsets}: {(ref != got).sum().item()} row ids differ"


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_plain_modulo_and_int32_ids(device):
    """fast_mod=False (the 64-bit %) and narrower id dtypes give the same rows."""
    from condmem.ops.hash.triton import hash_prefill_triton

    hasher = _hasher(4, 3, (1, 5), lookup=False)
    c = hasher.constants(device)
    ids = torch.randint(0, hasher.vocab_size, (2, 21), generator=torch.Generator().manual_seed(3)).to(device)
    blocked = (torch.rand(2, 21, generator=torch.Generator().manual_seed(4)) < 0.3).to(device)
    ref = hasher.hash_compressed(ids, blocked=blocked, backend="torch")
    for fast_mod in (True, False):
        for dtype in (torch.int64, torch.int32):
            got = hash_prefill_triton(
                ids.to(dtype),
                multipliers=c["multipliers"],
                primes=c["primes"],
                magic=hasher._magic(torch.device(device)),
                offsets=c["offsets"],
                n_heads=3,
                pad_id=hasher.pad_compressed_id,
                blocked=blocked,
                fast_mod=fast_mod,
                block_t=16,
            )
            assert torch.equal(ref, got), (fast_mod, dtype)


@settings(max_examples=12 if INTERPRET else 40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    max_n=st.integers(2, 5),
    heads=st.sampled_from([1, 3, 8, 9]),
    n_layers=st.integers(1, 3),
    vocab=st.sampled_from([2, 17, 99_092, 2**20 + 7]),
    length=st.integers(1, 12),
    p_block=st.sampled_from([0.0, 0.3]),
    data_seed=st.integers(0, 2**31 - 1),
)
def test_prefill_property(max_n, heads, n_layers, vocab, length, p_block, data_seed):
    gen = np.random.default_rng(data_seed)
    layers = sorted(gen.choice(40, size=n_layers, replace=False).tolist())
    sizes = gen.integers(2, 5000, size=4).tolist()
    extra = int(gen.integers(0, 30))
    hasher = _hasher(
        max_n,
        heads,
        layers,
        sizes=sizes,
        vocab=vocab,
        extra_tokens=extra,
        seed=data_seed % 1000,
        pad_id=int(gen.integers(0, vocab + extra)),
    )
    ids = torch.from_numpy(gen.integers(0, hasher.vocab_size, size=(2, length)))
    blocked = torch.from_numpy(gen.random((2, length)) < p_block) if p_block else None
    for device in kernel_devices_here():
        x = ids.to(device)
        b = None if blocked is None else blocked.to(device)
        assert torch.equal(hasher(x, blocked=b, backend="torch"), hasher(x, blocked=b, backend="triton"))


if HAS_TRITON:
    import triton
    import triton.language as tl

    from condmem.ops.hash.triton import _mod, barrett_magic

    @triton.jit
    def _mod_kernel(x_ptr, p_ptr, m_ptr, o_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        msk = i < n
        x = tl.load(x_ptr + i, mask=msk, other=0)
        p = tl.load(p_ptr + i, mask=msk, other=2)
        m = tl.load(m_ptr + i, mask=msk, other=0)
        tl.store(o_ptr + i, _mod(x, p, m, True), mask=msk)


@pytest.mark.parametrize("device", DEVICES)
def test_barrett_modulo_edges(device):
    """umulhi-based x % p over the extremes: x near 2**63, tiny and huge primes."""
    gen = torch.Generator().manual_seed(11)
    n = 512
    primes = torch.tensor([2, 3, 5, 7, 16_000_057, 384_006_151, 2**31 - 1, 2**61 - 1, 2**62 - 57, (2**63 - 25)] * 52)[
        :n
    ]
    x = torch.randint(0, 2**62, (n,), generator=gen) * 2 + torch.randint(0, 2, (n,), generator=gen)
    x[:20] = 2**63 - 1
    x[20:40] = 0
    x[40:60] = primes[40:60] - 1
    x[80:100] = torch.where(primes[80:100] < 2**62, primes[80:100] * 2 - 1, primes[80:100] + 1)
    x[60:80] = primes[60:80]
    out = torch.empty_like(x).to(device)
    _mod_kernel[(triton.cdiv(n, 128),)](
        x.to(device), primes.to(device), barrett_magic(primes).to(device), out, n, BLOCK=128
    )
    expect = torch.tensor([int(a) % int(p) for a, p in zip(x.tolist(), primes.tolist())], dtype=torch.int64)
    assert torch.equal(out.cpu(), expect)


# ---------------------------------------------------------------------------- decode


def _run_decode(hasher, device, backend, seqs, prompt_lens, blocked_full, aliases):
    """Prefill each sequence's prompt into its own slot, then decode token by token.

    Returns per-step row ids of the live rows and the history after each step. Each step's
    batch holds the live rows, padding rows aliasing live slots (valid=False), and rows of
    slot -1; freeing and reusing slots happens along the way.
    """
    n_seq, length = seqs.shape
    hist = hasher.new_history(n_slots=n_seq + 2, device=device)
    slots = [hist.allocate() for _ in range(n_seq)]
    # Burn one slot and give it back, so a reused slot takes part too.
    spare = hist.allocate()
    hist.ids[spare] = 12345 % hasher.layout.compressed_vocab_size
    hist.free(spare)
    reused = hist.allocate()
    assert reused == spare and torch.all(hist.ids[reused] == hist.pad_id)
    hist.free(reused)
    for i, s in enumerate(slots):
        p = prompt_lens[i]
        hasher.prefill_history(
            hist, [s], seqs[i : i + 1, :p].to(device), blocked=blocked_full[i : i + 1, :p].to(device), check=False
        )
    rows_per_step, hist_per_step = [], []
    for t in range(min(prompt_lens), length):
        live = [i for i in range(n_seq) if t >= prompt_lens[i]]
        row_slots = [slots[i] for i in live] + [slots[a] for a in aliases] + [-1, 10**6]
        tokens = [int(seqs[i, t]) for i in live] + [7] * len(aliases) + [3, 5]
        valid = [True] * len(live) + [False] * len(aliases) + [True, True]
        blocked = [bool(blocked_full[i, t]) for i in live] + [False] * (len(aliases) + 2)
        perm = torch.randperm(len(row_slots), generator=torch.Generator().manual_seed(t))
        row_slots = torch.tensor(row_slots)[perm].to(device)
        tokens_t = torch.tensor(tokens)[perm].to(device)
        valid_t = torch.tensor(valid)[perm].to(device)
        blocked_t = torch.tensor(blocked)[perm].to(device)
        rows = hasher.decode(hist, row_slots, tokens_t, valid=valid_t, blocked=blocked_t, backend=backend)
        inv = torch.argsort(perm)
        rows = rows[inv.to(device)]
        rows_per_step.append((t, live, rows[: len(live)].cpu(), rows[len(live) :].cpu()))
        hist_per_step.append(hist.ids.cpu().clone())
    return rows_per_step, hist_per_step


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "max_n,heads,layers", [(2, 2, (4,)), (4, 3, (1, 5)), (5, 1, (0, 2, 9))], ids=["N2", "N4", "N5"]
)
def test_decode_history_equals_full_sequence(max_n, heads, layers, device):
    hasher = _hasher(max_n, heads, layers, seed=max_n)
    gen = torch.Generator().manual_seed(max_n * 7)
    n_seq, length = 3, 12
    seqs = torch.randint(0, hasher.vocab_size, (n_seq, length), generator=gen)
    blocked = torch.rand(n_seq, length, generator=gen) < 0.15
    prompt_lens = [1, 4, 6]
    full = hasher(seqs, blocked=blocked, backend="torch")  # [S, T, L, C]
    zero_rows = hasher.constants("cpu")["offsets"]  # padding rows: bucket 0 of every column
    results = {}
    for backend in ("torch", "triton"):
        results[backend] = _run_decode(hasher, device, backend, seqs, prompt_lens, blocked, aliases=[0, 2])
    for (t, live, rows, pad_rows), (_, _, rows_k, pad_rows_k) in zip(results["torch"][0], results["triton"][0]):
        assert torch.equal(rows, full[live, t]), f"reference decode differs from the full hash at step {t}"
        assert torch.equal(rows_k, rows), f"kernel decode differs from the reference at step {t}"
        assert torch.equal(pad_rows_k, pad_rows)
        assert torch.equal(pad_rows, zero_rows.expand_as(pad_rows))
    for h_ref, h_ker in zip(results["torch"][1], results["triton"][1]):
        assert torch.equal(h_ref, h_ker)


@pytest.mark.parametrize("lookup", [True, False], ids=["lookup", "no-lookup"])
@pytest.mark.parametrize(
    "max_n,heads,layers", [(2, 2, (4,)), (4, 3, (1, 5)), (5, 1, (0, 2, 9))], ids=["N2", "N4", "N5"]
)
def test_native_cpu_decode_equals_reference(max_n, heads, layers, lookup, monkeypatch):
    """The CPU decode hash (`hash.c`, what `decode` runs on CPU tensors by default) gives the
    reference's row ids and history, bit for bit: live, padding, aliasing, blocked and
    out-of-range rows, reused slots."""
    from condmem import native

    if not native.available():
        pytest.skip("native CPU code unavailable")
    hasher = _hasher(max_n, heads, layers, seed=max_n, lookup=lookup)
    gen = torch.Generator().manual_seed(max_n * 11)
    n_seq, length = 4, 14
    seqs = torch.randint(0, hasher.vocab_size, (n_seq, length), generator=gen)
    seqs[1, 9], seqs[2, 10] = -3, hasher.vocab_size + 7  # out of range: read the pad
    blocked = torch.rand(n_seq, length, generator=gen) < 0.15
    ref = _run_decode(hasher, "cpu", "torch", seqs, [1, 4, 6, 2], blocked, aliases=[0, 3])
    calls = []
    real = native.hash_decode
    monkeypatch.setattr(native, "hash_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = _run_decode(hasher, "cpu", None, seqs, [1, 4, 6, 2], blocked, aliases=[0, 3])
    assert len(calls) == len(got[0]), "decode did not run the native hash"
    for (t, _, rows, pad_rows), (_, _, rows_n, pad_rows_n) in zip(ref[0], got[0], strict=True):
        assert torch.equal(rows_n, rows) and torch.equal(pad_rows_n, pad_rows), f"step {t}"
    for h_ref, h_nat in zip(ref[1], got[1], strict=True):
        assert torch.equal(h_nat, h_ref)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_padding_rows_never_touch_history(device):
    hasher = _hasher(4, 2, (1,))
    hist = hasher.new_history(4, device=device)
    s0, s1 = hist.allocate(), hist.allocate()
    hasher.prefill_history(hist, [s0, s1], torch.tensor([[5, 6, 7], [8, 9, 10]]).to(device))
    before = hist.ids.clone()
    slots = torch.tensor([s0, s1, -1, s0]).to(device)
    valid = torch.tensor([False, False, True, False]).to(device)
    rows = hasher.decode(hist, slots, torch.tensor([1, 2, 3, 4]).to(device), valid=valid, backend="triton")
    assert torch.equal(hist.ids, before)
    assert torch.equal(rows.cpu(), hasher.constants("cpu")["offsets"].expand_as(rows.cpu()))


def test_history_slots_and_errors():
    hist = NgramHistory(2, 3, pad_id=9)
    a, b = hist.allocate(), hist.allocate()
    assert (a, b) == (0, 1) and hist.live_slots == [0, 1]
    with pytest.raises(HistoryError, match="in use"):
        hist.allocate()
    hist.free(a)
    with pytest.raises(HistoryError, match="not allocated"):
        hist.free(a)
    hist.ids[b] = 4
    hist.reset([b])
    assert torch.all(hist.ids == 9)
    tail = NgramHistory.tail_history(
        torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0]]),
        3,
        9,
        blocked=torch.tensor([[False, True, False, False], [False] * 4]),
        lengths=torch.tensor([4, 2]),
    )
    assert tail.tolist() == [[4, 3, 9], [6, 5, 9]]
    with pytest.raises(Exception, match="new_history"):
        _hasher(4).decode(NgramHistory(2, 3, 0), torch.tensor([0]), torch.tensor([1]))


def test_decode_reference_matches_prefill_on_cpu():
    """The torch decode step alone (CPU, no kernels) reproduces the full hash."""
    hasher = _hasher(3, 2, (1, 2), lookup=False)
    seq = torch.randint(0, hasher.vocab_size, (1, 9), generator=torch.Generator().manual_seed(5))
    full = hasher(seq, backend="torch")[0]
    hist = hasher.new_history(1)
    s = hist.allocate()
    c = hasher.constants("cpu")
    for t in range(9):
        rows = hash_decode_reference(
            hist.ids,
            torch.tensor([s]),
            seq[0, t : t + 1],
            multipliers=c["multipliers"],
            primes=c["primes"],
            offsets=c["offsets"],
            n_heads=2,
            pad_id=hasher.pad_compressed_id,
        )
        assert torch.equal(rows[0], full[t])


# ---------------------------------------------------------------------------- full V4.1-Flash geometry (GPU)


@pytest.fixture(scope="module")
def v41_hasher():
    cfg = EngramConfig.deepseek_v41_flash()
    gen = np.random.default_rng(41)
    lookup = np.concatenate([np.arange(99_092), gen.integers(0, 99_092, 129_280 - 99_092)])
    gen.shuffle(lookup)
    return NgramHasher(EngramLayout(cfg), token_lookup=lookup)


@pytest.mark.gpu
def test_v41_prefill_full_geometry(v41_hasher):
    hasher = v41_hasher
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 129_280, (4, 4099), generator=gen).cuda()
    doc_starts = (torch.rand(4, 4099, generator=gen) < 0.002).cuda()
    blocked = (torch.rand(4, 4099, generator=gen) < 0.01).cuda()
    ref = hasher(ids, doc_starts=doc_starts, blocked=blocked, backend="torch")
    got = hasher(ids, doc_starts=doc_starts, blocked=blocked)  # auto -> Triton on CUDA
    assert torch.equal(ref, got)
    assert int(got.max()) < max(hasher.layout.num_embeddings) and int(got.min()) >= 0
    # Hashing is causal: a prefix hashed on CPU gives the same rows as the prefix of the GPU result.
    ref_cpu = hasher(
        ids[:1, :257].cpu(), doc_starts=doc_starts[:1, :257].cpu(), blocked=blocked[:1, :257].cpu(), backend="torch"
    )
    assert torch.equal(ref_cpu, got[:1, :257].cpu())


@pytest.mark.gpu
def test_v41_decode_full_geometry(v41_hasher):
    hasher = v41_hasher
    n_seq, length, prompt = 256, 40, 8
    gen = torch.Generator().manual_seed(1)
    seqs = torch.randint(0, 129_280, (n_seq, length), generator=gen).cuda()
    full = hasher(seqs, backend="torch")
    hist = hasher.new_history(n_seq + 64, device="cuda")
    slots = torch.tensor([hist.allocate() for _ in range(n_seq)]).cuda()
    hasher.prefill_history(hist, slots, seqs[:, :prompt])
    pad = 64  # CUDA-graph style padding rows that alias live slots
    for t in range(prompt, length):
        row_slots = torch.cat([slots, slots[:pad]])
        tokens = torch.cat([seqs[:, t], torch.randint(0, 129_280, (pad,), generator=gen).cuda()])
        valid = torch.cat([torch.ones(n_seq, dtype=torch.bool), torch.zeros(pad, dtype=torch.bool)]).cuda()
        rows = hasher.decode(hist, row_slots, tokens, valid=valid)
        assert torch.equal(rows[:n_seq], full[:, t])
