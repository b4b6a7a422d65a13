"""SparseAdam against dense Adam, state that scales with rows touched, clipping, the schedule."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from condmem.train.optim import (
    SparseAdam,
    clip_grad_norm_,
    clip_gradients_,
    export_adamw_state,
    import_adamw_state,
    lr_factor,
)
from tests.helpers import assert_close, devices

ROWS, DIM = 40, 6


def sparse_grad(rows: torch.Tensor, values: torch.Tensor, n_rows: int = ROWS) -> torch.Tensor:
    return torch.sparse_coo_tensor(rows[None], values, (n_rows, DIM), check_invariants=True)


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.8, 0.95)], ids=["default", "lm"])
def test_matches_dense_adam_on_touched_rows_and_leaves_others(betas):
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(ROWS, DIM, generator=gen)
    sparse_p = torch.nn.Parameter(init.clone())
    dense_p = torch.nn.Parameter(init.clone())
    sparse_opt = SparseAdam([sparse_p], lr=0.05, betas=betas, eps=1e-8)
    dense_opt = torch.optim.Adam([dense_p], lr=0.05, betas=betas, eps=1e-8, foreach=False)
    touched = torch.tensor([3, 7, 8, 21, 39])  # read at every step
    for step in range(12):
        # Repeated ids (the same row read twice in a batch) must be summed.
        ids = torch.cat([touched, touched[:2]])
        values = torch.randn(len(ids), DIM, generator=gen)
        sparse_p.grad = sparse_grad(ids, values)
        dense_p.grad = sparse_grad(ids, values).to_dense()
        sparse_opt.step()
        dense_opt.step()
    assert_close("touched rows vs dense Adam", dense_p[touched], sparse_p[touched], atol=1e-6, rtol=1e-5)
    others = torch.ones(ROWS, dtype=torch.bool)
    others[touched] = False
    assert torch.equal(sparse_p[others], init[others]), "rows never read must not move"


def test_lazy_rows_move_only_when_read_and_state_scales_with_rows_touched():
    p = torch.nn.Parameter(torch.zeros(10_000, DIM))
    opt = SparseAdam([p], lr=0.1)
    p.grad = sparse_grad(torch.tensor([5, 9]), torch.ones(2, DIM), 10_000)
    opt.step()
    after_first = p.detach().clone()
    p.grad = sparse_grad(torch.tensor([9, 11]), torch.ones(2, DIM), 10_000)
    opt.step()
    assert torch.equal(p[5], after_first[5]), "a row not read at this step keeps its value (lazy Adam)"
    assert not torch.equal(p[9], after_first[9]) and not torch.equal(p[11], after_first[11])
    state = opt.state[p]
    assert state["n_slots"] == 3 and opt.state_rows() == 3
    assert state["exp_avg"].shape[0] < p.shape[0], "moments are kept for touched rows, not the whole table"
    # A row's first step is a full Adam first step: -lr * sign(g).
    assert_close("first step of row 11", torch.full((DIM,), -0.1), p[11].detach(), atol=1e-6)


def test_first_step_on_embedding_gradient_and_dense_gradients():
    table = torch.nn.Parameter(torch.randn(ROWS, DIM))
    ref = torch.nn.Parameter(table.detach().clone())
    ids = torch.tensor([[1, 2, 2, 30]])
    F.embedding(ids, table, sparse=True).pow(2).sum().backward()
    F.embedding(ids, ref).pow(2).sum().backward()
    assert table.grad.is_sparse and not ref.grad.is_sparse
    SparseAdam([table], lr=0.01).step()
    SparseAdam([ref], lr=0.01).step()  # dense gradient: its nonzero rows count as touched
    assert_close("sparse vs dense gradient input", ref, table, atol=1e-7)


def test_export_import_roundtrip_continues_identically():
    gen = torch.Generator().manual_seed(1)
    p1 = torch.nn.Parameter(torch.randn(ROWS, DIM, generator=gen))
    p2 = torch.nn.Parameter(p1.detach().clone())
    o1, o2 = SparseAdam([p1], lr=0.02), SparseAdam([p2], lr=0.02)
    grads = [
        sparse_grad(torch.randint(0, ROWS, (7,), generator=gen), torch.randn(7, DIM, generator=gen)) for _ in range(6)
    ]
    for g in grads[:3]:
        p1.grad = g
        o1.step()
        p2.grad = g
        o2.step()
    saved = o2.export_state({p2: "t"})
    o3 = SparseAdam([p2], lr=0.02)
    o3.import_state(saved, {p2: "t"})
    for g in grads[3:]:
        p1.grad = g
        o1.step()
        p2.grad = g
        o3.step()
    assert torch.equal(p1, p2)


def test_clip_grad_norm_counts_sparse_rows_once():
    a = torch.nn.Parameter(torch.zeros(ROWS, DIM))
    b = torch.nn.Parameter(torch.zeros(3))
    a.grad = sparse_grad(torch.tensor([4, 4]), torch.ones(2, DIM))  # one row with gradient 2
    b.grad = torch.full((3,), 2.0)
    want = math.sqrt(DIM * 4 + 3 * 4)
    norm = clip_grad_norm_([a, b], max_norm=1.0)
    assert abs(norm.item() - want) < 1e-5
    assert a.grad.is_sparse
    total = math.sqrt(a.grad.coalesce().values().pow(2).sum().item() + b.grad.pow(2).sum().item())
    assert abs(total - 1.0) < 1e-4
    small = torch.nn.Parameter(torch.zeros(2))
    small.grad = torch.tensor([0.1, 0.0])
    clip_grad_norm_([small], max_norm=1.0)
    assert torch.equal(small.grad, torch.tensor([0.1, 0.0])), "below the limit nothing changes"


def test_clip_gradients_of_mixed_dtypes_against_fp64():
    """Dense fp32 and bf16 gradients (multi-tensor norms and scaling) beside a sparse one: the
    norm to fp64's within 1e-6, and each gradient scaled as one multiply by the clip factor."""
    g = torch.Generator().manual_seed(0)
    grads = [
        torch.randn(7, 5, generator=g),
        torch.randn(3, generator=g).bfloat16(),
        sparse_grad(torch.tensor([1, 4, 4]), torch.randn(3, DIM, generator=g)).coalesce(),
        torch.randn(11, generator=g),
    ]
    dense = [x.values() if x.is_sparse else x for x in grads]
    want = math.sqrt(sum(float(x.double().pow(2).sum()) for x in dense))
    before = [x.clone() for x in dense]
    total = clip_gradients_(grads, max_norm=1.0)
    assert abs(float(total) - want) < 1e-6 * want
    scale = (1.0 / (total + 1e-6)).clamp(max=1.0)
    for x, old in zip(grads, before):
        assert torch.equal(x.values() if x.is_sparse else x, old * scale.to(old.dtype))


@pytest.mark.parametrize("max_norm", [0.5, 100.0], ids=["clipped", "not-clipped"])
def test_clipping_folded_into_fused_adamw(max_norm):
    """A fused AdamW given to the clipping divides its gradients by 1/scale as it steps: the same
    parameters as multiplying first (bit for bit where no clipping happens; within a rounding of each
    parameter where it does), and the gradients it does not own are still multiplied."""
    if not _fused_adamw_here():
        pytest.skip("this torch has no fused AdamW on CPU")
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(64, 16, generator=g), torch.randn(16, generator=g)]
    grads = [torch.randn(64, 16, generator=g), torch.randn(16, generator=g)]
    other_grad = torch.randn(8, generator=g)
    params = []
    for _ in range(2):
        ps = [torch.nn.Parameter(x.clone()) for x in start]
        for p, gr in zip(ps, grads):
            p.grad = gr.clone()
        params.append(ps)
    plain = torch.optim.AdamW(params[0], lr=1e-2, fused=True)
    folded = torch.optim.AdamW(params[1], lr=1e-2, fused=True)
    other = [other_grad.clone(), other_grad.clone()]
    norm_a = clip_gradients_([p.grad for p in params[0]] + [other[0]], max_norm)
    norm_b = clip_gradients_([p.grad for p in params[1]] + [other[1]], max_norm, folded)
    assert torch.equal(norm_a, norm_b) and torch.equal(other[0], other[1])
    assert (folded.grad_scale is not None) and torch.equal(params[1][0].grad, grads[0]), "left for the step"
    plain.step()
    folded.step()
    eps = torch.finfo(torch.float32).eps
    for a, b, s in zip(params[0], params[1], start):
        if max_norm > float(norm_a):
            assert torch.equal(a, b)
        else:  # the update off by its last bits, then the parameter rounded
            assert bool(((a - b).abs() <= 2 * eps * ((a - s).abs() + a.abs())).all())


def _fused_adamw_here() -> bool:
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    try:
        torch.optim.AdamW([p], fused=True).step()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def test_lr_schedule_warmup_then_cosine():
    f = [lr_factor(s, 100, 10, 0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:])), "monotone decay after warm-up"
    assert f[-1] == pytest.approx(0.1, abs=1e-3)
    assert lr_factor(200, 100, 10, 0.1) == pytest.approx(0.1)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("fused", [False, True])
def test_adamw_state_resumes_bit_for_bit_from_a_checkpoint_copy(device, fused):
    """An AdamW (foreach or fused) resumed from its exported state, read back on the CPU as a
    checkpoint is, takes the same next step as the optimizer that never stopped: a fused one's step
    count goes back beside its weights (on CUDA a CPU count fails the fused kernel)."""
    torch.manual_seed(0)
    x = torch.randn(16, 8, device=device)

    def model_and_optimizer():
        m = torch.nn.Linear(8, 4, device=device)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2, fused=fused)

    def step(m, opt):
        m(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()

    m, opt = model_and_optimizer()
    for _ in range(3):
        step(m, opt)
    saved = {k: v.cpu() for k, v in export_adamw_state(opt, {p: n for n, p in m.named_parameters()}).items()}
    resumed, opt2 = model_and_optimizer()
    resumed.load_state_dict(m.state_dict())
    import_adamw_state(opt2, saved, {p: n for n, p in resumed.named_parameters()})
    for p in resumed.parameters():
        count = opt2.state[p]["step"]
        assert count.dtype == torch.float32 and count.device == (p.device if fused else torch.device("cpu"))
    step(m, opt)
    step(resumed, opt2)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), resumed.parameters()))
