"""SparseAdam's fused Triton step (`condmem.ops.sparse_adam_triton`) against its torch path.

On the CPU the kernel runs in Triton's interpreter (``fused=True``). The two paths compute the
same ops in the same order, with one exception on the CPU only: torch's CPU fp32 ``sqrt`` is
not correctly rounded (about 1 result in 5 is 1 ulp off the IEEE square root; torch 2.13,
AVX512), the interpreter's ``np.sqrt`` is, and so is torch's on CUDA. So the CPU tests give the
torch path an IEEE sqrt (`ieee_sqrt`) to hold everything ``torch.equal``, and one test keeps
torch's own sqrt: moments, steps and slots still equal (no sqrt feeds them), rows within the
bound that rounding allows. On a GPU (``gpu`` marker) the paths are compared as they are.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from condmem.train.optim import SparseAdam

# The CPU tests run the kernel in Triton's interpreter (tests/conftest.py switches it on where
# there is no GPU); on a GPU machine the `gpu` test below compares the compiled kernel instead.
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="the CPU kernel runs in the Triton interpreter"
)

ROWS, DIM = 3000, 6
NEVER_READ = 2600  # rows from here on get no gradient
SIZES = [700, 50, 400, 900, 30]


@pytest.fixture
def ieee_sqrt(monkeypatch):
    """The torch path with a correctly rounded fp32 sqrt on the CPU (numpy's), as the kernel computes it."""
    torch_sqrt = torch.Tensor.sqrt

    def sqrt(self):
        if self.device.type == "cpu" and self.dtype == torch.float32:
            return torch.from_numpy(np.sqrt(self.detach().numpy()))
        return torch_sqrt(self)

    monkeypatch.setattr(torch.Tensor, "sqrt", sqrt)


def gradients(steps: int, dtype: torch.dtype, seed: int = 0, rows: int = ROWS, dim: int = DIM) -> list[torch.Tensor]:
    """Coalesced sparse gradients: three steps on 200 rows (rows read again), then rows all over
    [0, NEVER_READ) (fresh rows past the first 1024 and 2048 slots: the buffers grow), values over
    eight orders of magnitude; every 6th gradient dense (its nonzero rows count as touched)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        n = SIZES[s % len(SIZES)]
        ids = torch.randint(0, 200 if s < 3 else min(rows, NEVER_READ), (n,), generator=gen)
        scale = 10.0 ** torch.randint(-6, 2, (n, 1), generator=gen)
        values = (torch.randn(n, dim, generator=gen) * scale).to(dtype)
        grad = torch.sparse_coo_tensor(ids[None], values, (rows, dim), check_invariants=True).coalesce()
        out.append(grad.to_dense() if s % 6 == 5 else grad)
    return out


def train(opt: SparseAdam, p: torch.nn.Parameter, grads, lr: float = 0.05, first: int = 0) -> None:
    for s, grad in enumerate(grads, start=first):
        opt.param_groups[0]["lr"] = lr * (1 + s % 3)  # the rate changes between steps
        p.grad = grad.clone()
        opt.step()


def pair(dtype: torch.dtype, betas=(0.9, 0.999), rows: int = ROWS, dim: int = DIM):
    """(torch-path optimizer, its table, fused optimizer, its table) from the same start."""
    init = torch.randn(rows, dim, generator=torch.Generator().manual_seed(7)).to(dtype)
    ref_p, p = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    return SparseAdam([ref_p], betas=betas, fused=False), ref_p, SparseAdam([p], betas=betas, fused=True), p


def differences(ref_opt: SparseAdam, ref_p, opt: SparseAdam, p) -> list[str]:
    """What differs between two optimizers' tables and exported state, with max abs/rel differences."""
    out = []
    want, got = ref_opt.export_state({ref_p: "t"}), opt.export_state({p: "t"})
    pairs = {"rows": (ref_p.detach(), p.detach()), **{k: (want[k], got.get(k)) for k in want}}
    for name, (a, b) in pairs.items():
        if b is None or a.shape != b.shape:
            out.append(f"{name}: shape {None if b is None else tuple(b.shape)} != {tuple(a.shape)}")
        elif not torch.equal(a, b):
            d = (a.double() - b.double()).abs()
            rel = (d / a.double().abs().clamp_min(1e-30)).max()
            out.append(f"{name}: {int((d > 0).sum())} of {a.numel()} differ, max abs {d.max():.3g}, max rel {rel:.3g}")
    return out


@interpreted
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.95)], ids=["small-lerp-weight", "large-lerp-weight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fused_step_equals_the_torch_path(ieee_sqrt, dtype, betas):
    ref_opt, ref_p, opt, p = pair(dtype, betas)
    grads = gradients(14, dtype)
    capacities = []
    for s, grad in enumerate(grads):
        train(ref_opt, ref_p, [grad], first=s)
        train(opt, p, [grad], first=s)
        capacities.append(opt.state[p]["exp_avg"].shape[0])
    assert not differences(ref_opt, ref_p, opt, p), differences(ref_opt, ref_p, opt, p)
    state = opt.state[p]
    assert torch.is_tensor(state["n_slots"]) and opt.state_rows() == ref_opt.state_rows() > 2048
    assert len(set(capacities)) >= 2, f"the buffers should have grown: {capacities}"
    unread = torch.arange(NEVER_READ, ROWS)
    assert (state["slot_of_row"][unread] == -1).all() and torch.equal(p[unread], pair(dtype)[1][unread])


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_with_torch_cpu_sqrt_moments_are_equal_and_rows_within_its_rounding(dtype):
    """Torch's own CPU sqrt: a 1-ulp different sqrt changes an update by a few ulp, which may
    round the row (and, for bf16, the change) to a neighbour; nothing feeds back (the moments
    do not depend on the rows). Per step at most 4 * lr ulps of the change (|update| <= ~3.2
    for these betas) plus one ulp of the row, in the row's dtype."""
    ref_opt, ref_p, opt, p = pair(dtype)
    steps, lr = 20, 0.05
    grads = gradients(steps, dtype)
    train(ref_opt, ref_p, grads, lr)
    train(opt, p, grads, lr)
    assert [d for d in differences(ref_opt, ref_p, opt, p) if not d.startswith("rows")] == []
    eps = torch.finfo(dtype).eps
    bound = steps * (4 * (3 * lr) + ref_p.detach().float().abs().max()) * eps
    gap = (ref_p.detach().float() - p.detach().float()).abs().max()
    assert gap <= bound, f"rows differ by {gap:.3g}, more than the sqrt's rounding allows ({bound:.3g})"


def test_torch_path_on_the_cpu_by_default():
    p = torch.nn.Parameter(torch.zeros(ROWS, DIM))
    opt = SparseAdam([p])
    train(opt, p, gradients(2, torch.float32))
    assert isinstance(opt.state[p]["n_slots"], int), "CPU training keeps the torch path"


@interpreted
def test_no_device_value_is_read_between_growths(monkeypatch):
    """The fused path reads ``n_slots`` on the host (`SparseAdam.slot_count`) only at the steps
    whose bound could pass the capacity; condmem code calls no other tensor-to-Python conversion."""
    reads = []

    def recording(name):
        original = getattr(torch.Tensor, name)

        def method(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if f"{os.sep}condmem{os.sep}" in caller.co_filename:
                reads.append(f"{caller.co_name}: {name}")
            return original(self, *args, **kwargs)

        return method

    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, recording(name))
    ref_opt, ref_p, opt, p = pair(torch.float32)
    expected, seen = [], []
    for s, grad in enumerate(gradients(15, torch.float32)):
        if not grad.is_sparse:
            continue  # a dense gradient's rows are found by nonzero (a sync on a GPU)
        state = opt.state.get(p)
        bound = state["n_slots_bound"] if state and "n_slots_bound" in state else 0
        capacity = state["exp_avg"].shape[0] if state else 0
        expected.append(min(ROWS, bound + grad._nnz()) > capacity)
        reads.clear()
        train(opt, p, [grad], first=s)
        seen.append(list(reads))
    assert [bool(r) for r in seen] == expected, seen
    assert all(r == ["slot_count: __int__"] for r in seen if r), seen
    assert expected.count(False) >= 4, "too few steps without a read for the test to mean anything"


@interpreted
@pytest.mark.parametrize("first", ["fused", "torch"])
def test_checkpoint_round_trip_between_the_paths(ieee_sqrt, first):
    """State exported after steps of one path, imported into an optimizer of the other, trains on
    exactly as an uninterrupted torch-path run; the export has the torch path's format."""
    grads = gradients(12, torch.float32)
    ref_opt, ref_p, _, _ = pair(torch.float32)
    train(ref_opt, ref_p, grads)
    _, _, fused_opt, p = pair(torch.float32)
    before = fused_opt if first == "fused" else SparseAdam([p], fused=False)
    train(before, p, grads[:6])
    saved = before.export_state({p: "t"})
    n = before.state_rows()
    assert set(saved) == {"t.slot_of_row", "t.exp_avg", "t.exp_avg_sq", "t.row_step"}
    assert saved["t.slot_of_row"].dtype == torch.int32 and saved["t.exp_avg"].shape == (n, DIM)
    assert saved["t.row_step"].dtype == torch.float32 and saved["t.row_step"].shape == (n,)
    after = SparseAdam([p], fused=first != "fused")
    after.import_state({k: v.clone() for k, v in saved.items()}, {p: "t"})
    train(after, p, grads[6:], first=6)
    assert not differences(ref_opt, ref_p, after, p), differences(ref_opt, ref_p, after, p)


@interpreted
def test_the_same_optimizer_may_switch_paths(ieee_sqrt):
    ref_opt, ref_p, opt, p = pair(torch.float32)
    grads = gradients(9, torch.float32)
    train(ref_opt, ref_p, grads)
    for s, grad in enumerate(grads):
        opt.fused = s % 3 != 1
        train(opt, p, [grad], first=s)
    assert not differences(ref_opt, ref_p, opt, p), differences(ref_opt, ref_p, opt, p)


@interpreted
def test_bad_input_raises_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match="fused must be None, True or False"):
        SparseAdam([torch.nn.Parameter(torch.zeros(4, 2))], fused="yes")
    table = torch.nn.Parameter(torch.zeros(4, 2, dtype=torch.float64))
    table.grad = torch.ones(4, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="fp32/bf16/fp16"):
        SparseAdam([table], fused=True).step()
    SparseAdam([table]).step()  # fused=None: the torch path takes what the kernel does not
    for fused in (True, False):
        p = torch.nn.Parameter(torch.zeros(4, 2))
        p.grad = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.ones(2), (4, 2), check_invariants=True)
        with pytest.raises(ValueError, match="sparse in the rows only"):
            SparseAdam([p], fused=fused).step()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    p = torch.nn.Parameter(torch.zeros(4, 2))
    p.grad = torch.ones(4, 2)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        SparseAdam([p], fused=True).step()


def _call(**changes):
    from condmem.ops.sparse_adam_triton import sparse_adam_step

    rows, dim, cap = 10, 4, 8
    args = dict(
        row_ids=torch.tensor([0, 5, 9, -1, 10, 99]),
        grad=torch.ones(6, dim),
        param=torch.zeros(rows, dim),
        slot_of_row=torch.full((rows,), -1, dtype=torch.int32),
        n_slots=torch.zeros(1, dtype=torch.int64),
        exp_avg=torch.zeros(cap, dim),
        exp_avg_sq=torch.zeros(cap, dim),
        row_step=torch.zeros(cap),
        pow1=torch.tensor([1.0, 0.9, 0.81]),
        pow2=torch.tensor([1.0, 0.999, 0.998001]),
        lr=0.1,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
    )
    args.update(changes)
    sparse_adam_step(**args)
    return args


@interpreted
def test_kernel_checks_its_arguments_and_skips_rows_outside_the_table():
    args = _call()
    assert int(args["n_slots"]) == 3 and args["slot_of_row"].tolist() == [0, -1, -1, -1, -1, 1, -1, -1, -1, 2]
    moved = args["param"].ne(0).any(1).nonzero().flatten().tolist()
    assert moved == [0, 5, 9], "ids -1, 10 and 99 are outside the table: skipped"
    short = _call(exp_avg=torch.zeros(2, 4), exp_avg_sq=torch.zeros(2, 4), row_step=torch.zeros(2))
    assert short["slot_of_row"][9] == -1 and not short["param"][9].any(), "no room: skipped, not written past"
    for change, match in (
        (dict(row_ids=torch.tensor([0, 1], dtype=torch.int32), grad=torch.ones(2, 4)), "row_ids must be int64"),
        (dict(grad=torch.ones(6, 3)), r"grad must be .* \[6, 4\]"),
        (dict(slot_of_row=torch.full((10,), -1)), "slot_of_row must be int32"),
        (dict(n_slots=torch.zeros(1, dtype=torch.int32)), "n_slots must be an int64"),
        (dict(exp_avg=torch.zeros(8, 3)), "exp_avg must be contiguous fp32"),
        (dict(param=torch.zeros(10, 4, dtype=torch.float64)), "2-D fp32/bf16/fp16"),
    ):
        with pytest.raises(ValueError, match=match):
            _call(**change)


@interpreted
def test_the_old_rows_keyword_works_for_one_release_with_a_deprecation_warning():
    want = _call()
    with pytest.warns(DeprecationWarning, match=r"sparse_adam_step: the keyword rows= is deprecated.*row_ids="):
        got = _call(row_ids=None, rows=torch.tensor([0, 5, 9, -1, 10, 99]))  # the ids under the old name only
    assert torch.equal(got["param"], want["param"]) and torch.equal(got["slot_of_row"], want["slot_of_row"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fused_equals_the_torch_path_on_cuda_without_host_syncs(dtype):
    """50 steps of a 1M x 64 table on a GPU: the fused path (the default there) against the torch
    path, ``torch.equal`` (the message lists max abs/rel differences of whatever parts), and every
    fused step whose bound stays within the capacity runs under ``set_sync_debug_mode("error")``."""
    rows, dim, steps = 1 << 20, 64, 50
    gen = torch.Generator(device="cuda").manual_seed(0)
    init = torch.randn(rows, dim, device="cuda", generator=gen).to(dtype)
    ref_p, p = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    ref_opt = SparseAdam([ref_p], lr=1e-2, betas=(0.9, 0.95), fused=False)
    opt = SparseAdam([p], lr=1e-2, betas=(0.9, 0.95))
    silent = 0
    for s in range(steps):
        n = [3000, 20000, 500, 60000, 8000][s % 5]
        ids = torch.randint(0, rows // 8 if s < 25 else rows, (n,), device="cuda", generator=gen)
        scale = 10.0 ** torch.randint(-6, 2, (n, 1), device="cuda", generator=gen)
        values = (torch.randn(n, dim, device="cuda", generator=gen) * scale).to(dtype)
        grad = torch.sparse_coo_tensor(ids[None], values, (rows, dim), check_invariants=True).coalesce()
        for o in (ref_opt, opt):
            o.param_groups[0]["lr"] = 1e-2 * (1 + s % 3)
        ref_p.grad = grad.clone()
        ref_opt.step()
        state = opt.state.get(p)
        may_read = not state or min(rows, state["n_slots_bound"] + grad._nnz()) > state["exp_avg"].shape[0]
        p.grad = grad.clone()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(0 if may_read else "error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        silent += not may_read
    assert torch.is_tensor(opt.state[p]["n_slots"]), "the fused path is the default on CUDA"
    assert silent >= 25, f"only {silent} of {steps} steps ran without a possible read"
    diff = differences(ref_opt, ref_p, opt, p)
    assert not diff, f"{dtype}: fused != torch path after {steps} steps:\n" + "\n".join(diff)
